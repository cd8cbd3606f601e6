"""The main window's widgets: the session sidebar, the conversation view and input, compare.

The sidebar and the conversation widgets hold no app state: they show what they are given
and report what the user asks for through signals. The compare view runs its comparisons
through the bridge and saves them in the store itself, as it lives in its own window.
"""
