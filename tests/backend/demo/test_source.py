"""The demo source's pip helper process: started the way the installed app needs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# The parent runs isolated (-I), as the installed app does, with its own folder put on
# sys.path by hand (packaging/bevy_desktop); it spawns a helper the way ensure_base_gguf
# does and prints what the helper can import from.
PARENT = f"""
import json, os, subprocess, sys
sys.path.insert(0, {str(ROOT)!r})
from backend.demo.source import child_python_env
probe = "import json, sys; print(json.dumps(sys.path))"
seen = subprocess.run([sys.executable, "-c", probe], env={{**os.environ, **child_python_env()}},
                      capture_output=True, text=True, check=True).stdout
print(json.dumps({{"parent": sys.path, "child": json.loads(seen)}}))
"""


def test_helper_python_can_import_what_this_process_imports(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run(
        [sys.executable, "-I", "-c", PARENT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = json.loads(out)
    assert str(ROOT) in seen["child"]  # pip, in the installed app, sits beside the code
    assert {p for p in seen["parent"] if p} <= set(seen["child"])
