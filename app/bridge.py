"""The only object that talks to the engine: commands in, engine events out as Qt signals.

Engine events arrive on the service's dispatcher thread; they cross to the GUI thread
through a queued signal, so every public signal here fires on the main thread. Metrics
go through a throttle (newest wins, ~10 Hz). Loading a model takes seconds, so it runs
on a worker thread and reports progress; conversations never depend on an engine being
up (a reload stops the replies in flight, which the controller saves as stopped).
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal, Slot

from app.throttle import Throttle
from backend import api
from backend.api import (
    EngineConfig,
    ErrorEvent,
    Finished,
    SamplingParams,
    Submit,
    TokenEvent,
)


class Bridge(QObject):
    token = Signal(str, str)  # request id, new text
    finished = Signal(object)  # Finished
    failed = Signal(str, str)  # request id, message
    metrics = Signal(object)  # MetricsSnapshot, at most ~10 Hz
    # "loading" | "ready" | "error" (load failed) | "failed" (engine died) | "stopped", detail
    state_changed = Signal(str, str)
    load_progress = Signal(int, int)  # done, total
    compare_log = Signal(str)
    compare_done = Signal(object, str)  # records (list[dict]) or None, error message
    compare_progress = Signal(int, int)  # steps done, steps in all
    api_changed = Signal(str)  # URL being served, or "" when stopped
    api_error = Signal(str)  # the API could not start after a load (port in use, ...)
    # A watched remote engine (watch_remote): its name, its MetricsSnapshot or None, and
    # whether it reports one at all (False: not a Bevy server, or unreachable now).
    remote_metrics = Signal(str, object, bool)

    _event = Signal(object)  # from the dispatcher thread; queued to the GUI thread
    _snapshot = Signal(object)  # likewise: the throttle's timer lives on the GUI thread
    _loaded = Signal(int, object, object, str)  # load generation, service or None, config, error
    _engine_died = Signal(str)
    _progress = Signal(int, int)
    _phase = Signal(int, str)  # load generation, what the loader is doing
    _compared = Signal(object, str)
    _compare_step = Signal(int, int)
    _logged = Signal(str)
    _remote_snap = Signal(int, str, object, bool)  # watch generation, then as remote_metrics

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.service = None  # api.open_service's service once loaded
        self.model_path: Path | None = None
        self.config: EngineConfig | None = None
        self.state = "stopped"
        self.detail = ""
        self._api = None
        self._api_wanted: tuple[str, int, str | None] | None = None
        self._unsubscribe = None
        self._loader: threading.Thread | None = None
        self._generation = 0  # bumped per load: results of superseded loads are discarded
        self._next_load: tuple | None = None  # asked for while a load was running
        self._closing = False
        self._throttle = Throttle(interval_ms=100, parent=self)
        self._throttle.delivered.connect(self.metrics)
        # Queued even when emitted on the GUI thread (a refused submit answers at once):
        # the controller registers a request id after submit() returns, then sees its events.
        self._event.connect(self._on_event, Qt.ConnectionType.QueuedConnection)
        self._snapshot.connect(self._throttle.push)
        self._loaded.connect(self._on_loaded)
        self._engine_died.connect(self._on_engine_died)
        self._progress.connect(self.load_progress)
        self._phase.connect(self._on_phase)
        self._compared.connect(self.compare_done)
        self._compare_step.connect(self.compare_progress)
        self._compare_cancel: threading.Event | None = None
        self._logged.connect(self.compare_log)
        # Remote engines (Settings → Engines): one service per engine, and which one each
        # request in flight went to, so an abort reaches it.
        self._remotes: dict[str, api.RemoteService] = {}
        self._remote_ids: dict[str, api.RemoteService] = {}
        self._watching: tuple[api.Endpoint, threading.Event] | None = None
        self._watch_generation = 0
        self._remote_snap.connect(self._on_remote_snap)

    # --- engine lifetime ----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.service is not None

    @property
    def model_name(self) -> str:
        return self.service.model_name if self.service is not None else ""

    @property
    def expert_backend(self) -> str:
        """How the running engine computes experts (chosen when it started)."""
        return self.service.engine.expert_backend if self.service is not None else ""

    @property
    def memory_note(self) -> str:
        """What the running engine holds for the model under the cache or memory budget,
        and why ("cache auto: every expert, 1.52 GiB (19.8 GiB free, leaving 2.3 GiB)")."""
        return self.service.engine.memory_plan.note if self.service is not None else ""

    def load(self, model_path: str | Path | None, config: EngineConfig) -> None:
        """(Re)start the engine on ``model_path`` (None: the demo MoE) in the background.
        Asked again while loading, the newest request runs once the current load ends."""
        if self._loader is not None and self._loader.is_alive():
            self._next_load = (model_path, config)
            return
        self._generation += 1
        old, self.service = self.service, None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop_api_server()
        # Objects frozen when the old engine came up (see _on_loaded) must become
        # collectable again, or its weights and slots stay in memory for good.
        gc.unfreeze()
        self._set_state(
            "loading", f"Loading {Path(model_path).name if model_path else 'the demo MoE'}"
        )
        holder = [old] if old is not None else []  # the worker drops the last reference
        self._loader = threading.Thread(
            target=self._load_worker,
            args=(self._generation, holder, model_path, config),
            name="bevy-load",
            daemon=True,
        )
        self._loader.start()

    def _load_worker(
        self, generation: int, holder: list, model_path: str | Path | None, config: EngineConfig
    ) -> None:
        try:
            if holder:
                holder.pop().close()  # in-flight replies end with Finished(abort) / ErrorEvent
                gc.collect()  # free the old model before the new one loads beside it
            service, resolved = api.open_service(
                model_path,
                config,
                progress=self._progress.emit,
                phase=lambda text: self._phase.emit(generation, text),
            )
        except Exception as exc:  # any failure is shown in the window, never a crash
            self._loaded.emit(generation, None, config, f"{exc}")
            return
        if self._closing:  # the app quit while this model loaded
            service.close()
            return
        self._loaded.emit(generation, service, resolved, "")

    @Slot(int, str)
    def _on_phase(self, generation: int, text: str) -> None:
        if generation == self._generation and self.state == "loading":
            self._set_state("loading", text)

    @Slot(int, object, object, str)
    def _on_loaded(self, generation: int, service, config: EngineConfig, error: str) -> None:
        if self._closing or generation != self._generation:
            if service is not None:
                service.close()
            return
        if service is None:
            self._set_state("error", error)
        else:
            self.service, self.config, self.model_path = service, config, service.model.path
            self._unsubscribe = service.subscribe_metrics(self._snapshot.emit)
            service.on_failure(self._engine_died.emit)
            # Everything alive now (torch, Qt wrappers, the model) lives until the next
            # load; frozen, the collector stops walking it, a long pause with the GIL held.
            gc.freeze()
            if self._api_wanted is not None:
                err = self._start_api_server(*self._api_wanted)
                if err:
                    self.api_error.emit(err)
            self._set_state("ready", service.model_name)
        if self._next_load is not None:
            nxt, self._next_load = self._next_load, None
            self.load(*nxt)

    @Slot(str)
    def _on_engine_died(self, message: str) -> None:
        dead, self.service = self.service, None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop_api_server()
        if dead is not None:
            threading.Thread(target=dead.close, name="bevy-close", daemon=True).start()
        self._set_state("failed", message)

    def _set_state(self, state: str, detail: str) -> None:
        self.state, self.detail = state, detail
        self.state_changed.emit(state, detail)

    def shutdown(self) -> None:
        """Stop everything (app exit). A model still loading is closed by its worker."""
        self._closing = True
        self.watch_remote(None)
        for rid, remote in list(self._remote_ids.items()):
            remote.abort(rid)  # remote servers stop generating for a closed app
        self._stop_api_server()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.service is not None:
            self.service.close()
            self.service = None
        self._set_state("stopped", "")

    # --- requests -----------------------------------------------------------------------

    def submit(
        self,
        messages: list[dict],
        params: SamplingParams,
        session: str = "",
        tools: list[dict] | None = None,
        overflow: str = "error",
        continue_final: bool = False,
    ) -> str | None:
        """Queue a reply; returns its request id, or None when no engine is loaded.
        ``overflow``: what a chat longer than the context does (``Submit.overflow``);
        ``continue_final``: the reply goes on with the last (assistant) message."""
        if self.service is None:
            return None
        rid = self.service.new_id("app")
        msg = Submit(
            rid,
            params,
            messages=messages,
            tools=tools,
            session=session,
            overflow=overflow,
            continue_final=continue_final,
        )
        self.service.submit(msg, self._event.emit)
        return rid

    def submit_remote(
        self,
        engine: api.Endpoint,
        messages: list[dict],
        params: SamplingParams,
        continue_final: bool = False,
    ) -> str:
        """Queue a reply on a remote engine; its events come as a local reply's do."""
        service = self._remotes.get(engine.name)
        if service is None or service.endpoint != engine:  # new, or edited in Settings
            service = self._remotes[engine.name] = api.RemoteService(engine)
        rid = service.new_id("app")
        self._remote_ids[rid] = service
        msg = Submit(rid, params, messages=messages, continue_final=continue_final)
        service.submit(msg, self._event.emit)
        return rid

    def watch_remote(self, engine: api.Endpoint | None, every_s: float = 0.25) -> None:
        """Poll ``engine``'s ``/v1/stats`` for the panels on a worker thread, until another
        engine is watched (None: none). Results come as ``remote_metrics``."""
        if self._watching is not None:
            if self._watching[0] == engine:
                return
            self._watching[1].set()
        self._watching = None
        self._watch_generation += 1
        if engine is None:
            return
        stop, generation = threading.Event(), self._watch_generation
        self._watching = (engine, stop)

        def work() -> None:
            while not stop.is_set():
                stats = api.server_stats(engine, snapshot=True)
                data = (stats or {}).get("snapshot")
                snap = api.snapshot_from_json(data, time.perf_counter()) if data else None
                self._remote_snap.emit(generation, engine.name, snap, stats is not None)
                stop.wait(every_s)

        threading.Thread(target=work, name="bevy-remote-stats", daemon=True).start()

    def _on_remote_snap(self, generation: int, name: str, snap: object, reports: bool) -> None:
        if generation == self._watch_generation:  # not from an engine watched before
            self.remote_metrics.emit(name, snap, reports)

    def abort(self, request_id: str) -> None:
        remote = self._remote_ids.get(request_id)
        if remote is not None:
            remote.abort(request_id)  # its stream closes: the server stops too
        elif self.service is not None:
            self.service.abort(request_id)

    @Slot(object)
    def _on_event(self, ev: object) -> None:
        if isinstance(ev, TokenEvent):
            if ev.text:
                self.token.emit(ev.request_id, ev.text)
        elif isinstance(ev, Finished):
            self._remote_ids.pop(ev.request_id, None)
            self.finished.emit(ev)
        elif isinstance(ev, ErrorEvent):
            self._remote_ids.pop(ev.request_id or "", None)
            self.failed.emit(ev.request_id or "", ev.message)

    # --- compare runs -------------------------------------------------------------------

    def compare(
        self, policies: tuple[str, ...], workload: str, requests: int, cache: float, tokens: int
    ) -> bool:
        """Run a side-by-side policy comparison on a worker thread; False if no model."""
        service = self.service
        if service is None:
            return False

        cancel = self._compare_cancel = threading.Event()

        def work() -> None:
            try:
                records = service.compare(
                    policies,
                    workload,
                    requests,
                    cache,
                    tokens,
                    log=self._logged.emit,
                    progress=self._compare_step.emit,
                    cancel=cancel,
                )
            except Exception as exc:  # shown in the compare view ("cancelled" too)
                self._compared.emit(None, str(exc))
                return
            self._compared.emit(records, "")

        threading.Thread(target=work, name="bevy-compare", daemon=True).start()
        return True

    def cancel_compare(self) -> None:
        """Stop the running comparison before its next run (its current one finishes)."""
        if self._compare_cancel is not None:
            self._compare_cancel.set()

    # --- the local OpenAI-compatible API ------------------------------------------------

    def configure_api(
        self, enabled: bool, host: str = "127.0.0.1", port: int = 8080, key: str = ""
    ) -> None:
        """What to serve once an engine is up; takes effect at the next load."""
        self._api_wanted = (host, port, key or None) if enabled else None

    def set_api(
        self, enabled: bool, host: str = "127.0.0.1", port: int = 8080, key: str = ""
    ) -> str:
        """Serve this engine over HTTP now (same cache as the app's sessions); "" or an error."""
        self.configure_api(enabled, host, port, key)
        self._stop_api_server()
        if self._api_wanted is not None and self.service is not None:
            return self._start_api_server(*self._api_wanted)
        return ""

    def _start_api_server(self, host: str, port: int, key: str | None) -> str:
        try:
            self._api = api.start_api_server(self.service, host, port, key)
        except Exception as exc:  # port in use and the like: reported in settings
            self.api_changed.emit("")
            return str(exc)
        self.api_changed.emit(f"http://{host}:{self._api.port}/v1")
        return ""

    def _stop_api_server(self) -> None:
        if self._api is not None:
            self._api.stop()
            self._api = None
            self.api_changed.emit("")
