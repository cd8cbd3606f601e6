"""``python -m app``: start the desktop app (see :func:`app.main.main`)."""

import sys

from app.main import main

sys.exit(main())
