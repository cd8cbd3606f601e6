"""Per-session settings: system prompt and sampling overrides.

Only ticked fields are stored with the session; the rest follow the app settings, so a
later change of a default still reaches every session that did not override it.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.store import Session


class SessionSettingsDialog(QDialog):
    """``values()`` -> (system prompt, sampling overrides); unticked fields use the defaults."""

    def __init__(self, session: Session, defaults: dict, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Session settings — {session.title}")
        self.prompt = QPlainTextEdit(session.system_prompt)
        self.prompt.setPlaceholderText("System prompt (empty: the model's default)")
        own = session.sampling
        self.fields = {
            "temperature": QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2),
            "top_p": QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2),
            "max_tokens": QSpinBox(minimum=1, maximum=32768),
        }
        self.overrides = {}
        form = QFormLayout()
        form.addRow("System prompt", self.prompt)
        for key, box in self.fields.items():
            box.setValue(own.get(key, defaults[key]))
            tick = QCheckBox(f"Own {key.replace('_', ' ')}")
            tick.setChecked(key in own)
            box.setEnabled(key in own)
            tick.toggled.connect(box.setEnabled)
            self.overrides[key] = tick
            form.addRow(tick, box)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(buttons)

    def values(self) -> tuple[str, dict]:
        sampling = {
            k: self.fields[k].value() for k, tick in self.overrides.items() if tick.isChecked()
        }
        return self.prompt.toPlainText().strip(), sampling
