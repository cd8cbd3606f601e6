"""Dialogs the main window opens: app settings, per-session settings, the model manager.

Each is opened with ``open()``, never ``exec()``, so replies keep streaming behind it.
"""
