"""Coding-agent sessions: a workspace folder, tools that act on it, and the loop.

The loop (``loop.Agent``) asks a chat model for the next step with the tools offered,
checks each call it makes against the session's permission rules (``permissions``),
runs it on the workspace (``tools``, ``shell``) and appends the result, until the model
answers without a call, a step limit, or the user stops it. The model is anything with
``ChatModel``'s one method, so the same loop runs on the local engine, in the app or
the ``bevy agent`` command, and on a remote server.

No torch and no Qt here: the app imports this package (through ``backend.api``) to run
sessions on a worker thread, and tool calls come and go as OpenAI-shaped dicts.
"""
