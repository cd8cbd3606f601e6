"""The remote engines the user set up (Model → Engines): OpenAI-compatible servers a
session can run on instead of this computer's engine.

Names, URLs and models live in the app's settings; API keys go to the platform's keyring
(Secret Service on Linux, the Keychain on macOS) where one answers, else to a file only
the user can read in the app's data dir, and ``KeyStore.where`` says which, so Settings
can warn. Plain Python, no Qt.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from app.store import Store, data_dir
from backend.api import Endpoint

ENGINES_KEY = "engines"  # the store setting: [{"name", "base_url", "model"}, ...]
KEYRING_SERVICE = "bevy-desktop"
KEYS_FILE = "engine-keys.json"


class KeyStore:
    """API keys by engine name: the keyring when it works here, else ``KEYS_FILE``."""

    def __init__(self, folder: Path | None = None) -> None:
        self.file = (folder or data_dir()) / KEYS_FILE
        self._keyring = self._usable_keyring()

    @staticmethod
    def _usable_keyring():
        """The keyring module when its backend really stores secrets here; None when it
        has none (a headless machine without Secret Service), fails on use, or
        ``BEVY_KEYRING=off`` asks for the file (tests, and users who want no keyring)."""
        if os.environ.get("BEVY_KEYRING", "").lower() == "off":
            return None
        try:
            import keyring
            from keyring.errors import KeyringError

            backend = keyring.get_keyring()
            if getattr(backend, "priority", 0) <= 0:  # the fail and null backends
                return None
            keyring.get_password(KEYRING_SERVICE, "probe")  # D-Bus with no daemon fails here
            return keyring
        except (ImportError, KeyringError, RuntimeError, OSError):
            return None
        except Exception:  # a backend's own error types (jeepney, secretstorage)
            return None

    @property
    def where(self) -> str:
        """Where keys are kept, for the user."""
        if self._keyring is not None:
            return f"the system keyring ({type(self._keyring.get_keyring()).__name__})"
        return f"{self.file} (no system keyring here: readable by your user account only)"

    @property
    def secure(self) -> bool:
        return self._keyring is not None

    def get(self, name: str) -> str:
        if self._keyring is not None:
            return self._keyring.get_password(KEYRING_SERVICE, name) or ""
        return self._file_keys().get(name, "")

    def set(self, name: str, key: str) -> None:
        if self._keyring is not None:
            if key:
                self._keyring.set_password(KEYRING_SERVICE, name, key)
            else:
                self.delete(name)
            return
        keys = self._file_keys()
        if key:
            keys[name] = key
        else:
            keys.pop(name, None)
        self._write_file(keys)

    def delete(self, name: str) -> None:
        if self._keyring is not None:
            from keyring.errors import PasswordDeleteError

            with contextlib.suppress(PasswordDeleteError):  # it had no key
                self._keyring.delete_password(KEYRING_SERVICE, name)
            return
        keys = self._file_keys()
        if keys.pop(name, None) is not None:
            self._write_file(keys)

    def _file_keys(self) -> dict[str, str]:
        try:
            data = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_file(self, keys: dict[str, str]) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        # Created readable by the user alone, before any key is written into it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(keys, f)
        os.replace(tmp, self.file)


def load_engines(store: Store, keys: KeyStore | None = None) -> list[Endpoint]:
    """The remote engines, with their keys (``keys``: default, the platform's)."""
    keys = keys or KeyStore()
    out = []
    for e in store.get_setting(ENGINES_KEY, []) or []:
        if isinstance(e, dict) and e.get("name") and e.get("base_url"):
            out.append(Endpoint(e["name"], e["base_url"], e.get("model", ""), keys.get(e["name"])))
    return out


def find_engine(store: Store, name: str, keys: KeyStore | None = None) -> Endpoint | None:
    return next((e for e in load_engines(store, keys) if e.name == name), None)


def save_engines(store: Store, engines: list[Endpoint], keys: KeyStore | None = None) -> None:
    """Keep ``engines`` (their keys in ``keys``); a removed engine's key goes too."""
    keys = keys or KeyStore()
    names = {e.name for e in engines}
    if len(names) != len(engines):
        raise ValueError("two engines have the same name")
    if "" in names:
        raise ValueError("an engine needs a name")
    for old in store.get_setting(ENGINES_KEY, []) or []:
        if isinstance(old, dict) and old.get("name") not in names:
            keys.delete(str(old.get("name")))
    for e in engines:
        keys.set(e.name, e.api_key)
    store.set_setting(
        ENGINES_KEY, [{"name": e.name, "base_url": e.base_url, "model": e.model} for e in engines]
    )
