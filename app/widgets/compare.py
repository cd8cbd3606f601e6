"""The compare view: one small workload under several policies, timelines side by side.

Each policy runs on a fresh engine over the same prompts (`bevy bench` underneath, so the
tokens are checked against plain decoding); the view shows each run's link and compute
lanes over its decode phase with both-busy highlighted, its tokens/s and hit rate, and a
one-line explanation of the policy. Runs are saved in the database and can be reopened.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.panels._theme import make_plot, theme_for
from app.panels.overlap import IntervalsItem, intersect_intervals
from app.settings import POLICIES
from app.store import Store
from backend.api import POLICY_NOTES

COLUMNS = ("Policy", "tok/s", "× sync", "Hit rate", "Both busy", "Compute wait", "Exact")


class RunTimeline(QWidget):
    """One policy's lanes: link on top, both-busy in the middle, compute below."""

    def __init__(self, record: dict, span_s: float, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        theme = theme_for(self)
        lanes = record.get("lanes") or {"link": [], "compute": []}
        policy = record["policy"]
        title = QLabel(
            f"<b>{policy}</b> — {record['tokens_per_s']:.2f} tok/s, hit rate "
            f"{record['hit_rate']:.0%}, both busy {record['both_busy_frac']:.0%}"
            f"<br><span style='color:{theme.hex(theme.muted)}'>{POLICY_NOTES.get(policy, '')}</span>"
        )
        title.setWordWrap(True)
        self.plot = make_plot(theme)
        self.plot.setFixedHeight(90)
        item = self.plot.getPlotItem()
        item.hideAxis("left")
        item.setXRange(0, max(span_s, 1e-3), padding=0)
        item.setYRange(0, 2.4, padding=0)
        item.getAxis("bottom").setLabel("seconds into decode")
        self.items = {
            "compute": IntervalsItem(0.1, 0.8, theme.compute),
            "both": IntervalsItem(1.05, 0.4, theme.both),
            "link": IntervalsItem(1.5, 0.8, theme.link),
        }
        self.items["compute"].set_intervals(lanes["compute"])
        self.items["link"].set_intervals(lanes["link"])
        self.items["both"].set_intervals(intersect_intervals(lanes["link"], lanes["compute"]))
        for it in self.items.values():
            item.addItem(it)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 4)
        layout.addWidget(title)
        layout.addWidget(self.plot)


class CompareView(QWidget):
    def __init__(self, bridge: Bridge, store: Store, parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.WindowType.Window)
        self.setWindowTitle("Compare policies")
        self.resize(1000, 760)
        self.bridge, self.store = bridge, store
        self.records: list[dict] = []
        self.running = False
        self.policy_boxes = {p: QCheckBox(p) for p in POLICIES}
        for p, box in self.policy_boxes.items():
            box.setChecked(p in ("bevy", "sync", "prefetch-gate"))
            box.setToolTip(POLICY_NOTES[p])
        self.workload = QComboBox()
        self.workload.addItems(["chat", "agentic"])
        self.requests = QSpinBox(minimum=1, maximum=16, value=4)
        # In % of the experts, as Settings writes the app's cache.
        self.cache = QSpinBox(minimum=5, maximum=100, singleStep=5, value=30, suffix=" %")
        self.tokens = QSpinBox(minimum=2, maximum=256, value=16)
        self.run_button = QPushButton("Run")
        self.run_button.clicked.connect(self.run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop after the run in progress")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setFormat("%v of %m steps")
        self.progress.hide()
        self._started = 0.0
        self.log = QLabel("Runs each policy on a fresh engine over the same prompts.")
        self.log.setWordWrap(True)
        self.saved = QListWidget()
        self.saved.itemActivated.connect(self._open_saved)
        self.saved.itemClicked.connect(self._open_saved)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.timelines = QWidget()
        self.timeline_layout = QVBoxLayout(self.timelines)
        theme = theme_for(self)
        self.legend = QLabel(
            f"<span style='color:{theme.hex(theme.link)}'>■</span> link (expert loads) &nbsp; "
            f"<span style='color:{theme.hex(theme.both)}'>■</span> both busy &nbsp; "
            f"<span style='color:{theme.hex(theme.compute)}'>■</span> compute &nbsp; "
            "— decode phase of each run, on one time scale"
        )
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.timelines)

        controls = QFormLayout()
        row = QHBoxLayout()
        for box in self.policy_boxes.values():
            row.addWidget(box)
        controls.addRow("Policies", row)
        controls.addRow("Workload", self.workload)
        controls.addRow("Concurrent requests", self.requests)
        controls.addRow("Cache (of the experts)", self.cache)
        controls.addRow("Decode tokens", self.tokens)
        left = QVBoxLayout()
        left.addLayout(controls)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        left.addLayout(buttons)
        left.addWidget(self.progress)
        left.addWidget(self.log)
        left.addWidget(QLabel("Saved runs"))
        left.addWidget(self.saved, 1)
        right = QVBoxLayout()
        right.addWidget(self.table)
        right.addWidget(self.legend)
        right.addWidget(scroll, 1)
        layout = QHBoxLayout(self)
        layout.addLayout(left, 1)
        layout.addLayout(right, 3)
        bridge.compare_log.connect(self._on_log)
        bridge.compare_done.connect(self._on_done)
        bridge.compare_progress.connect(self._on_progress)
        self.refresh_saved()

    def run(self) -> bool:
        policies = tuple(p for p, box in self.policy_boxes.items() if box.isChecked())
        if len(policies) < 2:
            self.log.setText("Pick at least two policies.")
            return False
        if self.running:
            return False
        started = self.bridge.compare(
            policies,
            self.workload.currentText(),
            self.requests.value(),
            self.cache.value() / 100,
            self.tokens.value(),
        )
        if not started:
            self.log.setText("No model is loaded yet.")
            return False
        self.running = True
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self._started = time.monotonic()
        self._step, self._eta = "", ""
        self.progress.setRange(0, 0)
        self.progress.show()
        self.log.setText("Starting… (replies in your sessions slow the comparison down)")
        return True

    def cancel(self) -> None:
        if self.running:
            self.bridge.cancel_compare()
            self.cancel_button.setEnabled(False)
            self.log.setText("Cancelling after the run in progress…")

    def _on_progress(self, done: int, total: int) -> None:
        self.progress.setRange(0, total)
        self.progress.setValue(done)
        elapsed = time.monotonic() - self._started
        if done:
            left = elapsed / done * (total - done)
            self._eta = (
                f"about {left:.0f} s left" if left < 120 else f"about {left / 60:.0f} min left"
            )
        self._show_log()

    def _on_log(self, text: str) -> None:
        self._step = text
        self._show_log()

    def _show_log(self) -> None:
        if self.running and self.cancel_button.isEnabled():
            self.log.setText(" · ".join(p for p in (self._step, self._eta) if p))

    def _on_done(self, records: list[dict] | None, error: str) -> None:
        self.running = False
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        self.progress.hide()
        if records is None:
            cancelled = error == "cancelled"
            self.log.setText("Cancelled." if cancelled else f"The comparison failed: {error}")
            return
        policies = [r["policy"] for r in records]
        r0 = records[0]
        title = (
            f"{time.strftime('%Y-%m-%d %H:%M')} · {r0['workload']} × {r0['requests']} · "
            f"cache {r0['cache_fraction']:.0%} · {', '.join(policies)}"
        )
        self.store.save_compare(title, policies, r0["workload"], records)
        self.log.setText(f"Done: {title}")
        self.show_records(records)
        self.refresh_saved()

    def refresh_saved(self) -> None:
        self.saved.clear()
        for run in self.store.list_compares():
            item = QListWidgetItem(run.title)
            item.setData(Qt.ItemDataRole.UserRole, run.id)
            self.saved.addItem(item)

    def _open_saved(self, item: QListWidgetItem) -> None:
        self.show_records(self.store.load_compare(item.data(Qt.ItemDataRole.UserRole)).results)

    def show_records(self, records: list[dict]) -> None:
        self.records = records
        self.table.setRowCount(len(records))
        for row, r in enumerate(records):
            cells = (
                r["policy"],
                f"{r['tokens_per_s']:.2f}",
                "—" if r.get("ratio_to_sync") is None else f"{r['ratio_to_sync']:.2f}",
                f"{r['hit_rate']:.0%}",
                f"{r['both_busy_frac']:.0%}",
                f"{r['compute_wait_frac']:.0%}",
                "yes" if r.get("tokens_identical_to_reference") else "NO",
            )
            for col, text in enumerate(cells):
                self.table.setItem(row, col, QTableWidgetItem(text))
        while self.timeline_layout.count():
            w = self.timeline_layout.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        span = max((r.get("wall_s", 0.0) for r in records), default=1.0)
        for r in records:  # one time scale for all runs: slower runs show as longer
            self.timeline_layout.addWidget(RunTimeline(r, span))
        self.timeline_layout.addStretch(1)
