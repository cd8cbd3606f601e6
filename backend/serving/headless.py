"""The terminal demo ``bevy`` runs where there is no display: several chats at once, live.

A few prompts from the bundled chat workload run concurrently through one engine. While
they run, one line per session shows its layer, state and tokens, plus the cache hit rate,
how often link and compute were busy together, and tokens/s. On a terminal the block is
redrawn in place ~4 times a second; into a pipe or file it is printed every couple of
seconds instead, so logs stay readable. Then each reply and a stats table are printed.

Events reach us on the service's dispatcher thread; listeners only put them on a queue,
and all state and printing stay on the calling thread, which is also where Ctrl+C lands.
"""

from __future__ import annotations

import enum
import queue
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from backend.bench.workloads import load_workload
from backend.config import EngineConfig, SamplingParams
from backend.messages import (
    ErrorEvent,
    Event,
    Finished,
    MetricsSnapshot,
    RequestProgress,
    Submit,
    TokenEvent,
)
from backend.serving.service import EngineService

TTY_REFRESH_S = 0.25
PLAIN_REFRESH_S = 2.0
EXIT_INTERRUPTED = 130  # what shells report for a SIGINT death

_UP = "\x1b[{}F"  # cursor to the start of the line n lines up
_CLEAR = "\x1b[2K"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


class Status(enum.Enum):
    SUBMITTED = "submitted"
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"


@dataclass
class SessionRun:
    """One demo chat as seen from the terminal: updated from its events, main thread only."""

    name: str
    request_id: str
    messages: list[dict]
    submitted: float
    status: Status = Status.SUBMITTED
    tokens: int = 0
    text: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish: Finished | None = None
    error: str | None = None

    def apply(self, ev: Event, now: float) -> None:
        if isinstance(ev, TokenEvent):
            self.status = Status.RUNNING
            self.tokens += 1
            self.text.append(ev.text)
            if self.first_token_at is None:
                self.first_token_at = now
        elif isinstance(ev, Finished):
            self.status, self.finish, self.finished_at = Status.DONE, ev, now
            self.tokens = ev.completion_tokens
        elif isinstance(ev, ErrorEvent):
            self.status, self.error, self.finished_at = Status.ERROR, ev.message, now

    @property
    def over(self) -> bool:
        return self.status in (Status.DONE, Status.ERROR)

    @property
    def reply(self) -> str:
        return self.finish.text if self.finish is not None else "".join(self.text)

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.submitted

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prompt(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


def sample_sessions(n: int) -> list[tuple[str, list[dict]]]:
    """``n`` (name, messages) pairs from the chat workload, reusing prompts past its end."""
    if n < 1:
        raise ValueError(f"the demo needs at least one session, got {n}")
    records = load_workload("chat")
    out = []
    for i in range(n):
        rec = records[i % len(records)]
        lap = i // len(records)
        out.append((rec["id"] if lap == 0 else f"{rec['id']}#{lap + 1}", rec["messages"]))
    return out


def progress_lines(
    runs: list[SessionRun], snap: MetricsSnapshot | None, elapsed: float
) -> list[str]:
    """The live block: one line per session, then the engine's numbers."""
    live: dict[str, RequestProgress] = {p.request_id: p for p in snap.requests} if snap else {}
    width = max(len(r.name) for r in runs)
    lines = []
    for r in runs:
        p = live.get(r.request_id)
        if r.over or p is None:
            layer = "      -"
            state = r.status.value if r.over or r.status is Status.RUNNING else "queued"
        else:
            layer, state = f"{p.layer:>3}/{p.n_layers:<3}", p.state
        lines.append(f"{r.name:<{width}}  layer {layer}  {state:<9}  {r.tokens:>5} tok")
    if snap is None:
        lines.append(f"hit rate   -  both busy   -  tok/s    -  {elapsed:6.1f} s")
    else:
        lines.append(
            f"hit rate {snap.hit_rate:4.0%}  both busy {snap.both_busy_frac:4.0%}  "
            f"tok/s {snap.tokens_per_s:5.1f}  {elapsed:6.1f} s"
        )
    return lines


class LiveView:
    """Draws the progress block: in place on a terminal, as timestamped lines otherwise."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.interval = TTY_REFRESH_S if tty else PLAIN_REFRESH_S
        self._drawn = 0  # lines of the block now on screen (tty)
        self._last: float | None = None

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last >= self.interval

    def draw(self, lines: list[str], now: float, elapsed: float) -> None:
        self._last = now
        if self.tty:
            # A wrapped line would throw off the cursor-up count, so cut to the width.
            cols = shutil.get_terminal_size().columns
            # The cursor would flicker across the block on every redraw: hide it meanwhile.
            head = _UP.format(self._drawn) if self._drawn else _HIDE_CURSOR
            body = "".join(f"{_CLEAR}{line[: cols - 1]}\n" for line in lines)
            self.out.write(head + body)
            self._drawn = len(lines)
        else:
            self.out.write("".join(f"[{elapsed:6.1f} s] {line}\n" for line in lines))
        self.out.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self._drawn = 0
            self.out.write(_SHOW_CURSOR)
            self.out.flush()


def stats_table(runs: list[SessionRun], wall_s: float, engine_totals: dict[str, float]) -> str:
    """Per-session and total tokens and speeds, and the engine's totals for the run."""
    header = ("session", "prompt", "completion", "1st token s", "time s", "tok/s", "finish")
    rows = [header]
    for r in runs:
        first = f"{r.first_token_at - r.submitted:.2f}" if r.first_token_at is not None else "-"
        finish = r.finish.reason if r.finish is not None else "error"
        prompt = str(r.finish.prompt_tokens) if r.finish is not None else "-"
        rows.append(
            (
                r.name,
                prompt,
                str(r.tokens),
                first,
                f"{r.seconds:.2f}",
                f"{r.tokens_per_s:.1f}",
                finish,
            )
        )
    completion = sum(r.tokens for r in runs)
    prompt_total = sum(r.finish.prompt_tokens for r in runs if r.finish is not None)
    rows.append(
        (
            "total",
            str(prompt_total),
            str(completion),
            "",
            f"{wall_s:.2f}",
            f"{completion / wall_s if wall_s > 0 else 0.0:.1f}",
            "",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    fmt = lambda row: "  ".join(  # noqa: E731
        c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
        for i, (c, w) in enumerate(zip(row, widths, strict=True))
    ).rstrip()
    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths), *map(fmt, rows[1:])]
    lines.append(
        f"cache hit rate {engine_totals['hit_rate']:.1%}  ·  "
        f"both busy {engine_totals['both_busy_frac']:.1%}  ·  "
        f"fetched experts {int(engine_totals['fetched'])}  ·  "
        f"{completion / wall_s if wall_s > 0 else 0.0:.1f} tok/s overall"
    )
    return "\n".join(lines)


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def run_headless(
    model_path: Path | None,
    config: EngineConfig,
    n_sessions: int = 4,
    max_tokens: int = 64,
    out: TextIO = sys.stdout,
    params: SamplingParams | None = None,
) -> int:
    """Run ``n_sessions`` sample chats concurrently with live progress; 0 when all finished,
    1 when any failed, 130 on Ctrl+C. ``params`` overrides the sampling (its ``max_tokens``
    wins over ``max_tokens``); each session gets its own seed so the replies differ."""
    sessions = sample_sessions(n_sessions)
    base = params if params is not None else SamplingParams(max_tokens=max_tokens)
    view = LiveView(out, _isatty(out))
    service: EngineService | None = None
    try:
        if model_path is None:
            from backend.demo.build import ensure_demo

            model_path = ensure_demo()  # minutes on first use: Ctrl+C must work here too
        out.write(f"Loading {model_path.name} ...\n")
        out.flush()
        service = EngineService.open(model_path, config)
        out.write(
            f"{len(sessions)} concurrent sessions on {service.model_name} "
            f"({config.device}, policy {config.policy}; "
            f"{service.engine.memory_plan.note})\n"
        )
        runs = _run(service, sessions, base, view)
        view.close()
        for r in runs:
            out.write(f"\n== {r.name}: {r.prompt}\n")
            out.write(f"{r.reply}\n" if r.error is None else f"[error] {r.error}\n")
        t0 = min(r.submitted for r in runs)
        t1 = max(r.finished_at or t0 for r in runs)
        out.write("\n" + stats_table(runs, t1 - t0, _engine_totals(service, t0, t1)) + "\n")
        out.flush()
        return 0 if all(r.error is None for r in runs) else 1
    except KeyboardInterrupt:
        out.write("\nInterrupted: stopping the engine.\n")
        out.flush()
        return EXIT_INTERRUPTED
    finally:
        view.close()
        if service is not None:
            service.close()  # aborts whatever is still running


def _run(
    service: EngineService,
    sessions: list[tuple[str, list[dict]]],
    base: SamplingParams,
    view: LiveView,
) -> list[SessionRun]:
    events: queue.Queue[Event] = queue.Queue()
    runs = []
    for i, (name, messages) in enumerate(sessions):
        params = base if base.seed is not None else replace(base, seed=i)
        run = SessionRun(name, service.new_id("demo"), messages, time.perf_counter())
        runs.append(run)
        # The listener runs on the dispatcher thread: hand the event over and return.
        service.submit(Submit(run.request_id, params, messages=messages, session=name), events.put)
    by_id = {r.request_id: r for r in runs}
    t0 = runs[0].submitted
    while True:
        try:
            ev: Event | None = events.get(timeout=0.05)
        except queue.Empty:
            ev = None
        while ev is not None:  # drain: a fast engine queues many tokens between draws
            by_id[ev.request_id].apply(ev, time.perf_counter())
            try:
                ev = events.get_nowait()
            except queue.Empty:
                ev = None
        now = time.perf_counter()
        done = all(r.over for r in runs)
        if done or view.due(now):
            view.draw(progress_lines(runs, service.latest, now - t0), now, now - t0)
        if done:
            return runs


def _engine_totals(service: EngineService, t0: float, t1: float) -> dict[str, float]:
    """Whole-run numbers. Every request has ended, so the engine thread is idle and its
    counters are settled."""
    engine = service.engine
    return {
        "hit_rate": engine.cache.stats.hit_rate,
        "both_busy_frac": engine.telemetry.window(t0, t1)["both_busy_frac"],
        "fetched": engine.cache.stats.fetches,
    }
