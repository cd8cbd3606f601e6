"""One engine shared by many clients: app sessions and API requests interleave on it.

A chat's prompt (template, tokenizing, fitting it to the context) is made on a prompts
thread, not on the engine's: a long one must not stall every running request. The engine
has a single event queue; a dispatcher thread fans it out. Each request
registers a listener at submit time and gets exactly its own events, ending with one
terminal event (``Finished`` or ``ErrorEvent``). Metrics snapshots go to every metrics
subscriber and are kept as ``latest`` for pollers (``/v1/stats``). Listeners run on the
dispatcher thread: they must hand events on (queue, Qt signal) and return quickly.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from backend.config import EngineConfig
from backend.engine.loop import Engine, chat_prompt
from backend.errors import BevyError
from backend.messages import Abort, ErrorEvent, Event, Finished, MetricsSnapshot, Submit
from backend.models.loader import LoadedModel, Progress, load_model
from backend.text import grammar

Listener = Callable[[Event], None]
MetricsListener = Callable[[MetricsSnapshot], None]

_STOP = object()
log = logging.getLogger(__name__)


def resolve_device(name: str) -> str:
    """ "auto" picks CUDA, then Apple's MPS, then the CPU; other names pass through."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def open_model(path: str | Path, device: str = "cpu", progress: Progress | None = None):
    """Load a model that can serve chats: it must carry a tokenizer."""
    model = load_model(path, device=device, progress=progress)
    if model.tokenizer is None:
        raise BevyError(
            f"{path}: the model has no tokenizer (GGUF tokenizer metadata or tokenizer.json)"
        )
    return model


T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that ends with it. Models are loaded and engines
    started this way: a thread's first parallel torch op gives it an OpenMP thread pool
    for as long as it lives, and with a second live pool beside the engine thread's,
    libgomp counts more threads than cores and stops letting its workers spin between
    parallel regions, so every kernel call of the engine waited for its worker to wake
    (decoding a third slower on 2 cores: docs/performance.md)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="bevy-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[return-value]


DEGRADED_S = 60.0  # how long a server-side failure keeps /health "degraded"


class EngineService:
    """Owns a running Engine and routes its events; thread-safe."""

    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.model, self.config = model, config
        self.engine = Engine(model, config)
        self.model_name = model.path.stem if model.path.is_file() else model.path.name
        self._lock = threading.Lock()
        self._listeners: dict[str, Listener] = {}
        self._metrics: list[MetricsListener] = []
        self._failure_listeners: list[Callable[[str], None]] = []
        self._ids = itertools.count(1)
        self.latest: MetricsSnapshot | None = None
        self.failure: str | None = None  # set when the engine thread itself died
        # (monotonic time, message) of the latest request failed by the server's fault
        self.last_server_error: tuple[float, str] | None = None
        self._closed = False
        # Chats waiting for their prompt: id -> whether an abort came meanwhile.
        self._preparing: dict[str, bool] = {}
        self._chats: queue.SimpleQueue = queue.SimpleQueue()
        self.engine.start()
        self._thread = threading.Thread(target=self._dispatch, name="bevy-events", daemon=True)
        self._thread.start()
        self._prompts = threading.Thread(target=self._prepare, name="bevy-prompts", daemon=True)
        self._prompts.start()

    @classmethod
    def open(
        cls, path: str | Path, config: EngineConfig, progress: Progress | None = None
    ) -> EngineService:
        def start() -> EngineService:
            model = open_model(path, config.device, progress)
            grammar.prepare(model.tokenizer, model.config.vocab_size)
            if model.tokenizer is not None:  # read by every chat's fitting: worked out now
                _ = model.tokenizer.max_token_chars
            return cls(model, config)

        return on_fresh_thread(start)

    # --- requests -----------------------------------------------------------------------

    def new_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, msg: Submit, listener: Listener) -> None:
        """Queue a request; ``listener`` gets its events. A request refused here (engine
        down, id in use) gets its ErrorEvent on the calling thread, before this returns."""
        refusal = None
        chat = msg.messages is not None and msg.prompt_ids is None  # both: the engine refuses
        with self._lock:
            if self._closed or self.failure:
                refusal = self.failure or "the engine is shut down"
            elif msg.request_id in self._listeners:
                refusal = f"request id {msg.request_id!r} is in use"
            else:
                self._listeners[msg.request_id] = listener
                if chat:
                    self._preparing[msg.request_id] = False
        if refusal is not None:  # outside the lock: the listener may call back into us
            listener(ErrorEvent(msg.request_id, refusal))
        elif chat:
            self._chats.put(msg)
        else:
            self.engine.submit(msg)

    def abort(self, request_id: str) -> None:
        """Stop a request; its listener still receives ``Finished(reason="abort")``."""
        with self._lock:
            if request_id in self._preparing:  # the engine gets it right after its Submit
                self._preparing[request_id] = True
                return
        self.engine.submit(Abort(request_id))

    def _prepare(self) -> None:
        """The prompts thread: each chat Submit becomes a prompt_ids Submit, in order.
        Tokenizing lets go of the GIL (Tokenizer.encode), so the engine keeps running."""
        while (msg := self._chats.get()) is not _STOP:
            with self._lock:
                wanted = msg.request_id in self._listeners and not (self._closed or self.failure)
                aborted = self._preparing.get(msg.request_id, False)
                if not wanted or aborted:
                    self._preparing.pop(msg.request_id, None)
            if not wanted:
                continue  # its listener already got its end (shut down, engine failed)
            if aborted:  # stopped before its prompt was made: no need to make it
                self.engine.events.put(Finished(msg.request_id, "abort", "", 0, 0))
                continue
            try:
                ids, dropped = chat_prompt(self.model, msg)
            except Exception as exc:  # the request fails alone, as on the engine thread
                with self._lock:
                    self._preparing.pop(msg.request_id, None)
                self.engine.events.put(ErrorEvent(msg.request_id, str(exc)))
                continue
            ready = replace(msg, messages=None, prompt_ids=ids, dropped_messages=dropped)
            with self._lock:  # one order for the Submit and an abort that came meanwhile
                aborted = self._preparing.pop(msg.request_id, False)
                self.engine.submit(ready)
                if aborted:
                    self.engine.submit(Abort(msg.request_id))

    def degraded(self, window_s: float = DEGRADED_S) -> str | None:
        """Why the service is degraded: a request failed by the server's fault (an expert
        that cannot be read, say) in the last ``window_s``; None otherwise. Nothing can
        test the cause again on its own, so the state ends once it stops recurring."""
        last = self.last_server_error
        if last is None or time.monotonic() - last[0] > window_s:
            return None
        return last[1]

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._listeners)

    # --- metrics ------------------------------------------------------------------------

    def subscribe_metrics(self, listener: MetricsListener) -> Callable[[], None]:
        """Call ``listener`` with every snapshot (~10 Hz); returns the unsubscribe function."""
        with self._lock:
            self._metrics.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._metrics:
                    self._metrics.remove(listener)

        return unsubscribe

    # --- compare runs -------------------------------------------------------------------

    def compare(
        self,
        policies: tuple[str, ...],
        workload: str = "chat",
        requests: int = 4,
        cache: float = 0.3,
        tokens: int = 16,
        log: Callable[[str], None] = lambda _msg: None,
        progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[dict]:
        """Run one small workload under each policy (fresh engines on this model, on the
        calling thread); bench records with each run's lane intervals. ``progress`` and
        ``cancel`` as for ``bench.runner.run_bench``."""
        from backend.bench.runner import BenchPlan, run_bench

        plan = BenchPlan(
            policies=policies,
            workloads=(workload,),
            requests=(requests,),
            caches=(cache,),
            tokens=tokens,
            storage=self.config.storage,
            device=self.config.device,
            eviction=self.config.eviction,
            keep_lanes=True,
        )
        return run_bench(self.model, plan, log=log, progress=progress, cancel=cancel)

    # --- dispatch -----------------------------------------------------------------------

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with the reason if the engine thread itself dies."""
        with self._lock:
            self._failure_listeners.append(listener)

    def _dispatch(self) -> None:
        events = self.engine.events
        while True:
            ev = events.get()
            if ev is _STOP:
                return
            if isinstance(ev, MetricsSnapshot):
                self.latest = ev
                with self._lock:
                    targets = list(self._metrics)
                for m in targets:
                    _call(m, ev)
            elif isinstance(ev, ErrorEvent) and ev.request_id is None:
                self._fail_all(ev.message)  # the engine died: every open request ends
            else:
                if isinstance(ev, ErrorEvent) and ev.server:
                    self.last_server_error = (time.monotonic(), ev.message)
                terminal = isinstance(ev, Finished | ErrorEvent)
                with self._lock:
                    pop = self._listeners.pop if terminal else self._listeners.get
                    listener = pop(ev.request_id, None)
                if listener is not None:
                    _call(listener, ev)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self.failure = message
            listeners, self._listeners = self._listeners, {}
            failure_listeners = list(self._failure_listeners)
        for rid, listener in listeners.items():
            _call(listener, ErrorEvent(rid, message, server=True))
        for f in failure_listeners:
            _call(f, message)

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Abort everything in flight, stop the engine and the dispatcher."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._chats.put(_STOP)
        self._prompts.join(timeout=10)
        self.engine.shutdown()
        self.engine.events.put(_STOP)
        self._thread.join(timeout=10)
        with self._lock:
            listeners, self._listeners = self._listeners, {}
        for rid, listener in listeners.items():  # queued Submits the engine never saw
            _call(listener, ErrorEvent(rid, "the engine is shut down", server=True))


def _call(listener: Callable, arg: object) -> None:
    """One client's broken listener must not stop the events of all the others."""
    try:
        listener(arg)
    except Exception:
        log.exception("an engine event listener failed")


def collect(service: EngineService, msg: Submit, timeout: float = 600.0) -> list[Event]:
    """Submit and block until the request ends; its events in order (for CLIs and tests)."""
    q: queue.Queue[Event] = queue.Queue()
    service.submit(msg, q.put)
    out = []
    while True:
        ev = q.get(timeout=timeout)
        out.append(ev)
        if isinstance(ev, Finished | ErrorEvent):
            return out
