"""Settings say what an expert cache size costs for the chosen model, in MiB."""

from __future__ import annotations

from pathlib import Path

from app.dialogs.settings import SettingsDialog
from app.settings import DEFAULTS
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
    dialog.model.setCurrentIndex(dialog.model.findData(""))  # the demo MoE: not in entries
    assert dialog.cache_cost.text() == ""
