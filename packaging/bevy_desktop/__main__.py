"""The installed app's entry file: ``/usr/bin/bevy-desktop`` runs it with the system
Python, isolated (``-I``), so it puts the package's own folders first on ``sys.path``.

Installed layout (``packaging/linux-system``): ``<root>/app`` holds this package, ``app``,
``backend`` and ``resources``; ``<root>/app_packages`` the runtime dependencies."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "app"), str(ROOT / "app_packages")]
sys.argv[0] = "bevy-desktop"
# The launcher keeps bytecode out of the installed tree (-X pycache_prefix, or -B);
# Python helper processes (PyTorch starts some, pip another) must do the same, or a run
# as root leaves __pycache__ folders there that removing the package does not remove.
if sys.pycache_prefix:
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
elif sys.flags.dont_write_bytecode:
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"

from app.main import entry  # noqa: E402  (importable only once the paths are set)

sys.exit(entry())
