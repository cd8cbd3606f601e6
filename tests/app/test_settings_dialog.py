"""Settings say what an expert cache size costs for the chosen model, in MiB, and keep
each model's own settings."""

from __future__ import annotations

from pathlib import Path

from app.dialogs.settings import SettingsDialog
from app.settings import DEFAULTS, engine_config, merged
from backend.models.loader import inspect_model
from backend.serving.catalog import describe as describe_model


def test_the_cache_size_is_shown_in_mib_for_the_chosen_model(qtbot, tiny_chat_moe: Path) -> None:
    entry = describe_model(tiny_chat_moe)
    info = inspect_model(tiny_chat_moe)
    sizes = [sum(p.nbytes for p in e.parts) for layer in info.experts for e in layer]
    assert entry.n_experts == len(sizes) > 0 and entry.experts_total_bytes == sum(sizes)
    path = str(tiny_chat_moe)
    dialog = SettingsDialog(
        {**DEFAULTS, "model": path, "cache": "50%"}, [path], None, {path: entry}
    )
    qtbot.addWidget(dialog)
    half = round(len(sizes) / 2) * max(sizes)
    assert f"{half / 2**20:,.0f} MiB" in dialog.cache_cost.text()
    assert "50 %" in dialog.cache_cost.text()
    dialog.cache.setText("3")  # a count of experts
    assert f"{3 * max(sizes) / 2**20:,.0f} MiB" in dialog.cache_cost.text()
    dialog.cache.setText("lots")
    assert "not a size" in dialog.cache_cost.text()
    dialog.cache.setText("auto")  # the default: what it holds depends on the memory free
    assert "every expert" in dialog.cache_cost.text() and "GiB now" in dialog.cache_cost.text()
    dialog.cache.setText("30%")
    dialog.memory.setText("4GiB")  # one total: the cache gets what it leaves
    assert "what the memory limit leaves" in dialog.cache_cost.text()
    assert not dialog.cache.isEnabled()  # a model's own cache size does not apply
    assert engine_config(dialog.values()).cache == "auto"
    assert engine_config(dialog.values()).memory == "4GiB"
    dialog.memory.setText("lots")
    dialog.accept()
    assert "is not a size" in dialog.error.text() and dialog.result() == 0
    dialog.memory.setText("")
    assert dialog.cache.isEnabled()
    dialog.model.setCurrentIndex(dialog.model.findData(""))  # the demo MoE: not in entries
    assert dialog.cache_cost.text() == ""


def test_each_model_keeps_its_own_settings_and_gets_them_back_when_loaded(
    qtbot, env: Path, monkeypatch
) -> None:
    from app.main_window import MainWindow
    from app.settings import PROFILES_KEY
    from app.store import Store

    other = str(env.parent / "other.gguf")  # a second model: only its name matters here
    store = Store()
    w = MainWindow(store)
    qtbot.addWidget(w)
    loads: list[dict] = []  # what each engine load would use (loading is tested elsewhere)
    monkeypatch.setattr(w, "start_engine", lambda: loads.append(dict(w.settings)))
    mine = {"cache": "25%", "policy": "sync", "storage": "host", "context_overflow": "error"}
    w.apply_settings({**w.settings, "model": str(env), **mine})
    w.use_model(other)  # never set up: it loads with the settings as they are
    assert loads[-1]["model"] == other and loads[-1]["cache"] == "25%"
    w.apply_settings({**w.settings, "cache": "60%", "policy": "bevy"})
    w.use_model(str(env))
    assert {k: loads[-1][k] for k in mine} == mine  # its own again, not the other's
    assert store.get_setting(PROFILES_KEY)[other]["cache"] == "60%"
    assert w.controller.settings["context_overflow"] == "error"  # chats use it from now
    dialog = w.open_settings()
    assert dialog.cache.text() == "25%" and dialog.overflow.currentData() == "error"
    dialog.model.addItem(other, other)
    dialog.model.setCurrentIndex(dialog.model.findData(other))  # its settings come up
    assert dialog.cache.text() == "60%" and dialog.policy.currentText() == "bevy"
    assert dialog.storage.currentText() == "host"  # kept for it when it was set
    dialog.reject()
    w.close()
    store.close()


def test_settings_saved_with_the_old_default_cache_get_auto() -> None:
    """Before the memory limit existed every saved setting held the default cache, 30 %."""
    old = {k: v for k, v in DEFAULTS.items() if k != "memory"}
    assert merged({**old, "cache": "30%"})["cache"] == "auto"
    assert merged({**old, "cache": "50%"})["cache"] == "50%"  # chosen: kept
    assert merged({**DEFAULTS, "cache": "30%"})["cache"] == "30%"  # saved since: chosen
