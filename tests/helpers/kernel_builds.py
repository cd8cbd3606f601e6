"""The native kernels as each instruction-set variant compiles them, for the kernel tests."""

from __future__ import annotations

import ctypes

import pytest

from backend.kernels import native

# The library this machine uses; one built without AVX-512 (the AVX2 code, which machines
# without AVX-512 run); and on a CPU with AVX-512 VNNI one built without VNNI (the AVX-512
# code's byte products in two steps, as Skylake-X runs it).
VARIANTS = ("native", "avx2", "avx512-no-vnni")


def variant(name: str, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if name == "native":
        return native.library()
    if name == "avx2":
        return native.build(tmp_path_factory.mktemp("avx2"), extra_flags=("-mno-avx512f",))
    if " avx512_vnni" not in native._cpu_id():  # the flags -march=native compiles for
        pytest.skip("no AVX-512 VNNI here: the builds above are this CPU's code")
    return native.build(tmp_path_factory.mktemp("novnni"), extra_flags=("-mno-avx512vnni",))
