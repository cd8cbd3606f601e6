"""Per-session settings: system prompt, sampling overrides and (agents) permission rules.

Only ticked fields are stored with the session; the rest follow the app settings, so a
later change of a default still reaches every session that did not override it.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.store import Session
from backend import api

OVERFLOW_CHOICES = (
    ("", "As the model's settings say"),
    ("rolling", "Drop the oldest turns (keep the system prompt)"),
    ("truncate_middle", "Drop turns from the middle (keep the first one)"),
    ("error", "Stop with an error"),
)
RULES_HELP = (
    "One rule per line: allow | ask | deny, a tool (or *), a glob pattern matched against "
    "the command or path. E.g. 'allow run_command pytest *', 'deny run_command rm *', "
    "'allow write_file src/*'. Reading runs and changing asks when no rule matches."
)


class SessionSettingsDialog(QDialog):
    """``values()`` -> (system prompt, sampling overrides, agent rules, engine); unticked
    fields use the defaults."""

    def __init__(
        self,
        session: Session,
        defaults: dict,
        parent: QWidget | None = None,
        engines: list[str] | tuple[str, ...] = (),
    ) -> None:
        """``engines``: the remote engines' names (Model → Engines) a session can run on."""
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
        self.engine = QComboBox()
        self.engine.addItem("This computer (the local engine)", "")
        for name in engines:
            self.engine.addItem(name, name)
        if session.engine and self.engine.findData(session.engine) < 0:
            self.engine.addItem(f"{session.engine} (not set up any more)", session.engine)
        self.engine.setCurrentIndex(max(0, self.engine.findData(session.engine)))
        self.engine.setToolTip("Remote engines are set up in Model → Engines")
        form.addRow("Engine", self.engine)
        form.addRow("System prompt", self.prompt)
        for key, box in self.fields.items():
            box.setValue(own.get(key, defaults[key]))
            tick = QCheckBox(f"Own {key.replace('_', ' ')}")
            tick.setChecked(key in own)
            box.setEnabled(key in own)
            tick.toggled.connect(box.setEnabled)
            self.overrides[key] = tick
            form.addRow(tick, box)
        self.overflow = QComboBox()
        for key, text in OVERFLOW_CHOICES:
            self.overflow.addItem(text, key)
        self.overflow.setCurrentIndex(
            max(0, self.overflow.findData(own.get("context_overflow", "")))
        )
        form.addRow("When the chat outgrows the context", self.overflow)
        self.rules: QPlainTextEdit | None = None
        if session.kind == "agent":
            form.addRow("Workspace", QLabel(session.workspace))
            self.rules = QPlainTextEdit("\n".join(session.rules))
            self.rules.setPlaceholderText("allow run_command pytest *")
            self.rules.setToolTip(RULES_HELP)
            form.addRow("Rules", self.rules)
            help_label = QLabel(RULES_HELP)
            help_label.setWordWrap(True)
            form.addRow("", help_label)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self._check_and_accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(buttons)

    def _check_and_accept(self) -> None:
        try:
            self.rule_lines()
        except ValueError as exc:
            QMessageBox.warning(self, "Invalid rule", str(exc))
            return
        self.accept()

    def rule_lines(self) -> list[str] | None:
        """The agent's rules, each checked (ValueError names a bad one); None for a chat."""
        if self.rules is None:
            return None
        lines = [line.strip() for line in self.rules.toPlainText().splitlines() if line.strip()]
        return [str(api.Rule.parse(line)) for line in lines]

    def values(self) -> tuple[str, dict, list[str] | None, str]:
        sampling = {
            k: self.fields[k].value() for k, tick in self.overrides.items() if tick.isChecked()
        }
        if self.overflow.currentData():  # "" follows the model's setting: not stored
            sampling["context_overflow"] = self.overflow.currentData()
        return self.prompt.toPlainText().strip(), sampling, self.rule_lines(), self.engine_name()

    def engine_name(self) -> str:
        """The engine chosen: "" for the local one, else a remote engine's name."""
        return self.engine.currentData() or ""
