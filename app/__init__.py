"""Bevy Desktop: the PySide6 app (sessions, streaming chat, live engine panels, compare).

The app reaches the inference backend only through ``backend.api`` and never imports
torch (both enforced by import-linter), so the GUI depends on one stable surface and the
backend can change behind it.
"""
