"""What ``vs_llamacpp.py`` asks of llama.cpp's build: the x86 extensions the CPU reports."""

from __future__ import annotations

from benchmarks.vs_llamacpp import GGML_EXTRAS, ggml_isa

AVX512 = {"avx2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}


def test_llama_cpp_is_built_for_the_extensions_the_cpu_reports() -> None:
    # An Intel Xeon of these VMs (AMX left off whatever the CPU says), a Zen 4 (AVX-512
    # VNNI, no VEX-encoded AVX-VNNI), an AVX2 CPU with and without AVX-VNNI.
    xeon = AVX512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16", "avx_vnni", "amx_int8"}
    assert ggml_isa(xeon) == ["GGML_AVX512", *GGML_EXTRAS.values()]
    zen4 = AVX512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16"}
    assert ggml_isa(zen4) == [
        "GGML_AVX512",
        "GGML_AVX512_VNNI",
        "GGML_AVX512_VBMI",
        "GGML_AVX512_BF16",
    ]
    assert ggml_isa({"avx2", "avx_vnni"}) == ["GGML_AVX_VNNI"]
    assert ggml_isa({"avx2"}) == []
    # Without all five subsets ggml's AVX-512 code does not run: neither do its extensions.
    assert ggml_isa((AVX512 - {"avx512cd"}) | {"avx512_vnni"}) == []
