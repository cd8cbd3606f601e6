"""Remote engines' settings: names and URLs in the store, API keys in the keyring or,
where none works, in a file only the user can read; and the Engines dialog."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import keyring
import pytest
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

from app.dialogs.engines import EnginesDialog
from app.engines import KEYS_FILE, KeyStore, find_engine, load_engines, save_engines
from app.store import Store
from backend.api import Endpoint


class MemoryKeyring(KeyringBackend):
    """A keyring backend that keeps secrets in this process (keyring's own backend API):
    stands in for Secret Service, which this headless machine lacks."""

    priority = 1

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.secrets.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.secrets[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.secrets.pop((service, username), None) is None:
            raise PasswordDeleteError(username)


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "bevy.db", background_flush=False)
    yield s
    s.close()


def test_without_a_keyring_keys_go_to_a_file_only_the_user_reads(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyring, "get_keyring", lambda: keyring.backends.fail.Keyring())
    keys = KeyStore(tmp_path)
    assert not keys.secure and KEYS_FILE in keys.where and "no system keyring" in keys.where
    lab = Endpoint("lab", "http://gpu:8000", "qwen", "sk-1")
    save_engines(store, [lab, Endpoint("home", "http://10.0.0.2:8080/v1")], keys)
    path = tmp_path / KEYS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "sk-1" not in str(store.get_setting("engines"))  # never in the settings
    again = load_engines(store, KeyStore(tmp_path))
    assert again == [lab, Endpoint("home", "http://10.0.0.2:8080/v1")]
    assert (
        again[0].api_base == "http://gpu:8000/v1" and again[1].server_root == "http://10.0.0.2:8080"
    )
    save_engines(store, [Endpoint("home", "http://10.0.0.2:8080/v1")], keys)  # lab removed
    assert "sk-1" not in path.read_text() and find_engine(store, "lab", keys) is None
    with pytest.raises(ValueError, match="same name"):
        save_engines(store, [lab, lab], keys)


def test_with_a_keyring_the_keys_live_there(store: Store, tmp_path: Path) -> None:
    ring, before = MemoryKeyring(), keyring.get_keyring()
    keyring.set_keyring(ring)  # keyring's own way to choose a backend
    try:
        keys = KeyStore(tmp_path)
        check_keyring(store, keys, ring, tmp_path)
    finally:
        keyring.set_keyring(before)


def check_keyring(store: Store, keys: KeyStore, ring: MemoryKeyring, tmp_path: Path) -> None:
    assert keys.secure and "MemoryKeyring" in keys.where
    save_engines(store, [Endpoint("lab", "http://gpu:8000/v1", "qwen", "sk-2")], keys)
    assert ring.secrets == {("bevy-desktop", "lab"): "sk-2"}
    assert not (tmp_path / KEYS_FILE).exists()
    assert find_engine(store, "lab", keys).api_key == "sk-2"
    save_engines(store, [], keys)
    assert ring.secrets == {}
    os.environ["BEVY_KEYRING"] = "off"  # asked for the file, the keyring is left alone
    try:
        assert not KeyStore(tmp_path).secure
    finally:
        del os.environ["BEVY_KEYRING"]


def test_the_engines_dialog_edits_the_list_and_asks_the_server_for_models(qtbot) -> None:
    dialog = EnginesDialog([Endpoint("lab", "http://127.0.0.1:9/v1", "m", "k")], "a file", False)
    qtbot.addWidget(dialog)
    assert dialog.name.text() == "lab" and dialog.model.currentText() == "m"
    dialog.fetch_models()  # nothing listens on port 9: said in the dialog, not raised
    qtbot.waitUntil(lambda: "cannot be reached" in dialog.status.text(), timeout=10_000)
    dialog.add_engine()
    dialog.url.setText("gpu-box:8000")
    dialog.url.textEdited.emit("gpu-box:8000")
    dialog.accept()
    assert "must start with http" in dialog.error.text() and dialog.result() == 0  # kept open
    dialog.url.setText("http://gpu-box:8000")
    dialog.url.textEdited.emit("http://gpu-box:8000")
    dialog.remove_engine()  # the new one again
    assert [e.name for e in dialog.engines()] == ["lab"]
    dialog.list.setCurrentRow(0)
    dialog.name.setText("lab-2")
    dialog.name.textEdited.emit("lab-2")
    assert dialog.renames() == {"lab": "lab-2"}  # its sessions follow it (main window)
