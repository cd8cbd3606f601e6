"""The engine: one long-lived thread running schedule -> run -> postprocess.

A job is "MoE of layer l + attention and router of layer l+1" for one request. The
issuer *claims* a job's experts all at once (pins resident ones, reserves slots and
queues fetches for missing ones) or not at all, so jobs never deadlock on each other's
pins; the policy orders claims and picks which ready jobs compute together. A job that
needs more experts than the cache has slots (prefill with a tiny cache) streams them
through in chunks, accumulating its MoE output.

A prompt longer than ``prefill_chunk`` tokens is read in parts instead (chunked prefill):
its layer's MoE a few experts at a time on all of its rows (each expert read and
multiplied once for the whole prompt, and for every other long prompt at that layer:
the one furthest behind reads first, so prompts read at once meet at each layer), then
the rest of the job a slice of rows at a time, so other requests' jobs run between
parts. While both wait, the parts get at most ``PREFILL_SHARE`` of the compute time:
running chats go on at a bounded slowdown, and the prompt still makes steady progress.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from backend.config import EngineConfig, MemoryPlan, plan_memory, system_memory
from backend.engine import experts
from backend.engine.balance import Balancer
from backend.engine.cache import Claims, ExpertCache
from backend.engine.experts.grouped import GROUPED_BYTES
from backend.engine.fetcher import QUEUED_EXPERTS, Fetcher
from backend.engine.jobs import JobRunner, longest_slice, slice_end
from backend.engine.memory import release_pages, rss_bytes, trim_heap
from backend.engine.pool import ComputePool, cpu_domain
from backend.engine.prefetch import PREFETCH_PRIORITY, Prefetcher
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Ride, make_policy, progress, prompt_part, riders, split
from backend.engine.store import open_store
from backend.engine.telemetry import Telemetry
from backend.errors import BevyError
from backend.messages import (
    Abort,
    ErrorEvent,
    Event,
    Finished,
    MetricsSnapshot,
    RequestProgress,
    Shutdown,
    Submit,
    TokenEvent,
)
from backend.models.generate import fit_chat, prompt_room
from backend.models.loader import LoadedModel
from backend.models.transformer import KVCache
from backend.text.grammar import Matcher
from backend.text.sampling import make_generator, sample
from backend.text.stops import StopMatcher

# The scratch a memory budget keeps beside KV, for what the process takes after the
# engine starts: libraries loaded on first use, thread stacks, the allocator's slack, and
# per row of the largest job this many float32 vectors of the model's width (hidden
# states, attention and MoE inputs and outputs, the allocator keeping freed ones). Sized
# from measurement (docs/performance.md, "Memory budgets").
_SCRATCH_BASE = 128 << 20
_SCRATCH_ROW_VECTORS = 64

# Warm-up reads (``EngineConfig.warm``) go after every demand read and prefetch, and at
# most this many are queued at once: a request that claims an expert still being warmed
# waits behind no more than these.
_WARM_PRIORITY = (PREFETCH_PRIORITY + 1,)
_WARM_QUEUED = 2 * QUEUED_EXPERTS

# While a long prompt's slices and other jobs are both ready, the share of compute time
# the slices get. Half: a running chat decodes at no less than half its speed, and the
# prompt is read at no less than half of its own.
PREFILL_SHARE = 0.5


@dataclass(frozen=True)
class _FetchDone:
    key: tuple[int, int]
    layout: tuple[int, int, int] | None
    error: str | None


def short_switch_interval() -> None:
    # The link thread hands the GIL back after every read; with CPython's default 5 ms
    # switch interval it would wait behind compute's Python code for each expert.
    if sys.getswitchinterval() > 0.0005:
        sys.setswitchinterval(0.0005)


def chat_prompt(model: LoadedModel, msg: Submit) -> tuple[list[int], int]:
    """A chat Submit's prompt ids, fitted to the context by its overflow policy, and how
    many messages that left out. Raises BevyError (ContextTooLong) when it cannot fit."""
    room = prompt_room(model, msg.params.max_tokens)
    return fit_chat(model, msg.messages, msg.tools, room, msg.overflow, msg.continue_final)


# Engines holding torch's pool on a CUDA device to their budget, the newest last: the
# cap is one setting per process and device, so closing one engine restores the cap of
# the newest left, or none.
_POOL_CAPS: dict[int, list[tuple[Engine, float]]] = {}


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _cap_pool(engine: Engine, device: torch.device, budget: int) -> None:
    """torch's allocator keeps freed blocks for reuse, and jobs of varying sizes left
    its pool at three times what was in use (measured on an H200): held to the budget,
    it releases cached blocks instead of growing past it."""
    index = _cuda_index(device)
    fraction = min(1.0, budget / torch.cuda.get_device_properties(index).total_memory)
    _POOL_CAPS.setdefault(index, []).append((engine, fraction))
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def _uncap_pool(engine: Engine, device: torch.device) -> None:
    index = _cuda_index(device)
    caps = [c for c in _POOL_CAPS.get(index, []) if c[0] is not engine]
    _POOL_CAPS[index] = caps
    torch.cuda.set_per_process_memory_fraction(caps[-1][1] if caps else 1.0, index)


class Engine:
    def __init__(
        self, model: LoadedModel, config: EngineConfig, events: queue.Queue | None = None
    ) -> None:
        if not model.config.is_moe:
            raise BevyError(
                f"{model.path}: a dense model has no routed experts to offload; use `bevy generate`"
            )
        self.model, self.config = model, config
        self.policy = make_policy(config.policy)
        self.events: queue.Queue[Event] = events if events is not None else queue.Queue()
        self._wake: queue.Queue = queue.Queue()
        device = model.transformer.device
        self._compute_threads = torch.get_num_threads()
        self.store = open_store(config.storage, model.experts, pin_memory=device.type == "cuda")
        c = model.config
        fmt = config.slot_format
        if fmt == "auto":
            fmt = "stored"
        self.slot_format = fmt
        decoded_numel = 3 * c.hidden_size * c.expert_intermediate_size
        dtype = model.transformer.dtype
        slot_bytes = decoded_numel * dtype.itemsize if fmt == "decoded" else self.store.slot_bytes
        n_experts = c.n_routed_experts
        # Lockstep policies move the whole batch layer by layer, as llama.cpp's batch, and
        # bevy-static its fixed groups: a prompt's slices would leave its batch behind.
        together = self.policy.lockstep or self.policy.group_size
        self.prefill_chunk = 0 if together else config.prefill_chunk
        try:  # before the slots are allocated: a backend that cannot run fails first
            backend_name = experts.choose(
                config.expert_backend,
                model.experts,
                dtype if fmt == "decoded" else torch.uint8,
                device,
                dtype,
                use_native=config.native,
                use_compile=config.compile,
                plain=model.config.plain_experts,
                act=model.config.native_act,
            )
        except BevyError:
            self.store.close()
            raise
        # The cache budget holds the slots and the decoded working set together: what the
        # user sets (or "auto" finds room for) is what the experts take.
        self.memory_plan = self._plan(n_experts, slot_bytes, backend_name)
        self.cache_budget_bytes = self.memory_plan.slots * slot_bytes
        self.kv_budget_bytes = self.memory_plan.kv_bytes
        expert_bytes = decoded_numel * dtype.itemsize
        # Decoded experts kept for reuse, taken out of the same budget. None by default: at
        # an equal budget, slots bought more than decoded copies on every backend measured
        # (docs/performance.md), as a prompt's job decodes each expert once for all its
        # rows anyway and decoding reads stored bytes natively.
        working_set = 0
        if fmt == "stored" and config.working_set_mib:
            working_set = (config.working_set_mib << 20) // expert_bytes
        self.working_set_bytes = working_set * expert_bytes
        self._expert_bytes = expert_bytes
        self._dense_bytes = model.transformer.held_bytes()
        n_slots = (self.cache_budget_bytes - self.working_set_bytes) // slot_bytes
        if n_slots < model.config.top_k:
            self.store.close()
            held = (
                f" after its {self.working_set_bytes >> 20} MiB working set"
                if self.working_set_bytes
                else ""
            )
            raise ValueError(
                f"a cache of {n_slots} slots{held} is below the legal minimum of "
                f"{model.config.top_k} (one token's experts)"
            )
        # Within a total budget the KV room no running request holds lends the cache
        # slots, taken back as requests are admitted (``_fit_cache``): short chats leave
        # most of it empty. Where pages can be given back one slot at a time (a CPU on
        # Linux): a GPU allocation holds all its bytes at once.
        spare = 0
        if self.memory_plan.shared and device.type == "cpu" and sys.platform == "linux":
            spare = max(0, min(n_experts - n_slots, self.kv_budget_bytes // slot_bytes))
        if spare:
            self.memory_plan = replace(
                self.memory_plan,
                note=f"{self.memory_plan.note}; up to {spare} experts more while "
                "requests leave KV room free",
            )
        self._base_slots = n_slots
        n_alloc = n_slots + spare
        self.cache = ExpertCache(n_slots, config.eviction, spare=spare)
        self.claims = Claims(self.cache)
        if fmt == "decoded":
            self.slots = torch.empty((n_alloc, decoded_numel), dtype=dtype, device=device)
        elif device.type == "cuda":
            self.slots = torch.empty(
                (n_alloc, self.store.slot_bytes), dtype=torch.uint8, device=device
            )
        else:
            self.slots = self.store.alloc_slots(n_alloc)
        self.slot_bytes = slot_bytes
        self._fit_cache(0)
        self.layouts: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._warm_up_decoders()
        self.telemetry = Telemetry()
        backend = experts.build(
            backend_name,
            model.transformer,
            model.experts,
            self.cache,
            self.slots,
            self.layouts,
            working_set,
        )
        self.expert_backend = backend.name
        self.jobs = JobRunner(model.transformer, backend)
        self.prefetcher = (
            Prefetcher(self.policy.prefetch, model, self.claims, self.telemetry)
            if self.policy.prefetch
            else None
        )
        self.jobs.on_route = self._on_route
        self.jobs.on_pass = self._on_pass
        self._n_routed = sum(len(layer) for layer in model.experts)
        wake = self._wake  # (not self: the callback would tie the fetcher to the engine)
        self.fetcher = Fetcher(
            self.store,
            self.slots,
            self.telemetry,
            lambda k, lay, err: wake.put(_FetchDone(k, lay, err)),
            decode=dtype if fmt == "decoded" else None,
            use_aio=config.aio,
            # This thread takes the C loop's landed experts itself (``_drain``): a thread
            # of the link's for them woke for each one and took the GIL from this one.
            caller_takes=True,
            link_rate=config.link_rate,
        )
        # Every expert where each has a slot; where fewer fit, as many as the free slots
        # take, the same share of each layer (the i-th expert of every layer, then the
        # next), so that a first chat waits on the disk for the rest only. That one begins
        # once the engine is idle (a server's start, before its first chat), not under
        # requests already reading what they need. Those being read now.
        self._warm: deque[tuple[int, int]] = deque()
        self._warm_when_idle = self.cache.n_slots < self._n_routed
        if config.warm:
            widest = max(map(len, model.experts), default=0)
            order = (
                (i, e)
                for e in range(widest)
                for i, layer in enumerate(model.experts)
                if e < len(layer)
            )
            self._warm.extend(itertools.islice(order, self.cache.n_slots))
        self._warming: set[tuple[int, int]] = set()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids: set[str] = set()
        self._arrivals = itertools.count()
        self._tick = 0
        # Prompts a split run may start on (``scheduler.split``): those read whole.
        self._split_rows = self.prefill_chunk or sys.maxsize
        # Compute seconds of slices and of other jobs while both were ready (see ``_pick``),
        # and whether they both are for the job this step runs.
        self._slice_s = self._other_s = 0.0
        self._contended = False
        self._stopped = False
        self._trim_when_idle = False  # a request finished since the heap was last trimmed
        self._last_metrics = 0.0
        self._snapshot_at = 0.0  # the previous snapshot's time ("computing" since then)
        # Keys and values of the softmax attention layers; linear attention layers hold a
        # fixed-size recurrent state per request instead (``state_bytes``).
        model.transformer.set_kv_type(config.kv_type)
        self.kv_bytes_per_token = c.kv_values_per_token * model.transformer.kv_dtype.itemsize
        # The compute team sized to the CPUs other processes (and a cgroup's quota) leave
        # it; on an accelerator the CPU's threads carry little of the work.
        cpus = cpu_domain() if device.type == "cpu" else None
        self.pool = (
            ComputePool.of(cpus, self._compute_threads)
            if cpus is not None and self._compute_threads > 1
            else None
        )
        starved = cpus is not None and cpus.starved
        self.balancer = Balancer(starved) if self.policy.balance else None
        self._resized_on: int | None = None  # the thread whose team the pool resized
        self._thread: threading.Thread | None = None
        self._capped = device.type == "cuda" and bool(config.memory)
        if self._capped:  # last: an engine that failed to start leaves no cap behind
            _cap_pool(self, device, self.memory_plan.total_bytes)
        # Tests set this to a dict to receive every request's logits (exactness checks).
        self.logits_log: dict[str, list[torch.Tensor]] | None = None

    def _plan(self, n_experts: int, slot_bytes: int, backend: str) -> MemoryPlan:
        """Cache slots and KV budget under the user's budget (``plan_memory``), counting
        what the process holds now: on a CUDA device the pool torch's allocator holds
        there (the CUDA context itself is the driver's, outside it), elsewhere RAM
        (unified on Apple silicon)."""
        c, device = self.model.config, self.model.transformer.device
        if device.type == "cuda":
            # Blocks freed earlier (a closed engine's slots) would count as held.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            held = torch.cuda.memory_reserved(device)
        else:
            total, free = system_memory()
            held = rss_bytes()
        # Activations of the largest job (a prompt slice, or a whole prompt where slices
        # are off or the policy never slices) besides KV: what running requests take
        # beyond what admission counts.
        chunk = self.prefill_chunk
        rows = longest_slice(chunk) if chunk else min(c.context_length, 4096)
        scratch = _SCRATCH_BASE + rows * c.hidden_size * 4 * _SCRATCH_ROW_VECTORS
        if backend == "grouped":  # a layer's experts decoded at once, beside their bytes
            per_layer = c.n_experts * 3 * c.hidden_size * c.expert_intermediate_size * 4
            scratch += min(GROUPED_BYTES, per_layer) + c.n_experts * slot_bytes
        try:
            return plan_memory(
                self.config,
                n_experts=n_experts,
                slot_bytes=slot_bytes,
                min_slots=c.top_k,
                held_bytes=held,
                scratch_bytes=scratch,
                free_bytes=free,
                total_bytes=total,
            )
        except ValueError:
            self.store.close()
            raise

    def _warm_up_decoders(self) -> None:
        """Compile the fused expert decoders and dense-weight kernels now (seconds, once
        per shape) rather than while the first request waits for its first token."""
        from backend.kernels import fastquant
        from backend.kernels.quants import block_shape

        if self.model.transformer.device.type != "cpu":
            return
        self.model.transformer.warm_up()
        shapes = {
            (p.qtype, p.nbytes // block_shape(p.qtype)[1], block_shape(p.qtype)[1])
            for layer in self.model.experts
            for ref in layer[:1]
            for p in ref.parts
            if p.qtype in fastquant.KERNELS
        }
        for qtype, n_blocks, block_bytes in shapes:
            fastquant.warm_up(qtype, n_blocks, block_bytes)

    # --- public API (any thread) --------------------------------------------------------

    def submit(self, msg: Submit | Abort | Shutdown) -> None:
        self._wake.put(msg)
        self.fetcher.wake()  # where this thread waits in the link (``_drain``)
        self.jobs.stop.value = 1  # a walk through the layers stops for it at the next one

    def start(self) -> None:
        """Run the loop on its own thread."""
        short_switch_interval()
        self._thread = threading.Thread(target=self.loop, name="bevy-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.submit(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.close()

    def close(self) -> None:
        self.fetcher.close()
        self.store.close()
        if self._capped:
            _uncap_pool(self, self.slots.device)
        # Hooks are bound methods of their owners (the job runner's the engine's, the
        # cache's the native expert backend's): cycles that would keep the slots, the
        # whole cache budget, alive until the garbage collector's next full pass, which
        # may come many engines later (each `bevy bench` run opens one).
        self.jobs.unhook()
        self.cache.on_ready = self.cache.on_gone = None
        # A caller that stepped the engine on its own thread (``bevy bench``) gets back the
        # team size it had, not the pool's last.
        if self._resized_on == threading.get_ident():
            torch.set_num_threads(self._compute_threads)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def _warm_held(self) -> bool:
        """A warm-up under a budget that requests have kept from beginning (it begins at
        an idle step): nothing of it is being read."""
        return self._warm_when_idle and not self._warming and not self.idle

    @property
    def has_work(self) -> bool:
        """Requests in flight, or messages not yet handled."""
        return not self.idle or not self._wake.empty()

    # --- the loop -----------------------------------------------------------------------

    def loop(self) -> None:
        # The link thread sets one intra-op thread for itself, which also becomes the
        # default for threads started later: restore the compute thread's own count.
        torch.set_num_threads(self._compute_threads)
        try:
            while not self._stopped:
                self.step(block=True)
        except Exception as exc:  # the engine itself failed: tell every client
            self._emit(ErrorEvent(None, f"engine failed: {exc!r}", server=True))
            raise

    def step(self, block: bool = False) -> bool:
        """One iteration: schedule -> run -> postprocess. Returns whether a job ran (a
        split run, ``scheduler.split``, does not count: no request moved on)."""
        self.jobs.stop.value = 0  # what arrives from here on is drained after the next job
        # Before the step's jobs: a quota's size holds from the first one on.
        pool = self.pool
        if pool and (n := pool.poll(time.perf_counter())) and n != torch.get_num_threads():
            torch.set_num_threads(n)
            self._resized_on = threading.get_ident()
        self._drain(block=False)
        if self._warm and not self._warming and not self._warm_held:
            self._warm_more()  # the first step (or idle one); after it, each read's end
        self._admit()
        group = self._schedule()
        if isinstance(group, Request):
            self._run_slice(group)
        elif group:
            t0 = time.perf_counter()
            self._run(group)
            if self._contended:
                self._other_s += time.perf_counter() - t0
        elif (
            self.policy.split
            and not self._held
            and (part := split(self.running, self.cache.is_ready, self._split_rows))
        ):
            self._run_split(part)
        elif block or self.running:
            if self._trim_when_idle and self.idle:
                # What finished requests freed (a long prompt's activations) stays in the C
                # heap's free lists, resident, until trimmed: give it back while nothing
                # waits on this thread.
                self._trim_when_idle = False
                trim_heap()
            self._drain(block=True, timeout=0.05 if self.running else 0.2)
        self._maybe_metrics()
        return bool(group)

    def run_until_idle(self, timeout_s: float = 600.0) -> None:
        """Drive the loop on the calling thread until every request has finished."""
        short_switch_interval()
        deadline = time.monotonic() + timeout_s
        self._drain(block=False)
        while self.has_work:
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not finish in time")
            self.step(block=False)

    # --- messages -----------------------------------------------------------------------

    def _drain(self, block: bool, timeout: float = 0.0) -> None:
        if self.fetcher.caller_takes:
            # The landed experts first (reported into ``_wake``); with nothing to do, this
            # thread waits in the link, which ``submit`` wakes for a message.
            self.fetcher.take(timeout if block and self._wake.empty() else 0.0)
            block = False
        try:
            msg = self._wake.get(timeout=timeout) if block else self._wake.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._wake.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: object) -> None:
        if isinstance(msg, _FetchDone):
            warmed = msg.key in self._warming
            if warmed:
                self._warming.discard(msg.key)
                self._warm_more()
            if msg.error is not None:
                for r in self.claims.cancel(msg.key, list(self.running)):
                    self._emit(ErrorEvent(r.id, msg.error, server=True))
                    self._finish(r, "error")
            else:
                self.layouts[msg.key] = msg.layout
                self.cache.complete(msg.key)
                if warmed:
                    self.jobs.experts.warmed(msg.key)
        elif isinstance(msg, Submit):
            self._on_submit(msg)
        elif isinstance(msg, Abort):
            self._finish_by_id(msg.request_id, "abort")
        elif isinstance(msg, Shutdown):
            for r in list(self.running) + list(self.waiting):
                self._finish(r, "abort")
            self._stopped = True

    def _on_submit(self, msg: Submit) -> None:
        try:
            if msg.request_id in self._ids:
                raise BevyError(f"request id {msg.request_id!r} is already in use")
            if (msg.messages is None) == (msg.prompt_ids is None):
                raise BevyError("give exactly one of messages or prompt_ids")
            ctx = self.model.config.context_length
            if msg.prompt_ids is not None:
                ids, dropped = list(msg.prompt_ids), msg.dropped_messages
            else:
                ids, dropped = chat_prompt(self.model, msg)
            if not ids:
                raise BevyError("the prompt is empty")
            if len(ids) >= ctx:
                raise BevyError(f"the prompt has {len(ids)} tokens; the model's context is {ctx}")
            vocab = self.model.config.vocab_size
            if any(type(i) is not int or not 0 <= i < vocab for i in ids):
                raise BevyError(f"prompt token ids must be in [0, {vocab})")
            need = self._kv_bytes(min(len(ids) + msg.params.max_tokens, ctx))
            if need > self.kv_budget_bytes:
                raise BevyError(
                    f"prompt + max_tokens needs {need >> 20} MiB of KV cache, more than the "
                    f"{self.kv_budget_bytes >> 20} MiB budget (a larger --memory or "
                    "--kv-budget, or fewer max_tokens)"
                )
            tok = self.model.tokenizer
            grammar = None
            if msg.params.grammar is not None:
                if tok is None:
                    raise BevyError("constrained decoding needs the model's tokenizer")
                grammar = Matcher(tok, vocab, msg.params.grammar)
        except Exception as exc:  # any bad request fails alone, never the engine
            self._emit(ErrorEvent(msg.request_id, str(exc)))
            return
        r = Request(msg.request_id, ids, msg.params, session=msg.session, grammar=grammar)
        r.dropped_messages = dropped
        r.generator = make_generator(msg.params)
        r.decoder = tok.stream_decoder() if tok is not None else None
        r.stops = StopMatcher(msg.params.stop)
        self._ids.add(r.id)
        self.waiting.append(r)

    # --- admission ----------------------------------------------------------------------

    def _kv_tokens(self, r: Request) -> int:
        return min(r.budget_tokens, self.model.config.context_length)

    def _kv_bytes(self, tokens: int) -> int:
        """Bytes of KV (and recurrent state) a request of ``tokens`` may ever hold."""
        return tokens * self.kv_bytes_per_token + self.model.config.state_bytes

    def _kv_need(self, r: Request) -> int:
        """What admission counts for ``r``."""
        return self._kv_bytes(self._kv_tokens(r))

    def _kv_held(self) -> int:
        """KV bytes admission counts for the running requests."""
        return sum(self._kv_need(r) for r in self.running)

    def _fit_cache(self, kv: int) -> bool:
        """Size the cache to its planned slots and those the KV room beyond ``kv`` bytes
        lends it, giving back the memory of slots it leaves; False, changing nothing,
        where the entries it would have to drop are in use (admission waits for them)."""
        cache = self.cache
        n = self._base_slots + max(0, self.kv_budget_bytes - kv) // self.slot_bytes
        if min(n, cache.n_alloc) == cache.n_slots:
            return True
        released = cache.resize(n)
        if released is None:
            return False
        for slot in released:
            release_pages(self.slots[slot])
        return True

    def _admit(self) -> None:
        if not self.waiting:
            return
        # Lockstep policies add requests only between steps, as llama.cpp's batch does.
        if self.policy.lockstep and any(r.layer != 0 or r.done for r in self.running):
            return
        budget = self.kv_budget_bytes
        used = self._kv_held()
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.config.max_active:
            r = self.waiting[0]
            need = self._kv_need(r)
            if used + need > budget or not self._fit_cache(used + need):
                break
            used += need
            self.waiting.popleft()
            r.status, r.arrival = RequestStatus.RUNNING, next(self._arrivals)
            r.kv = KVCache(self.model.config.n_layers, max_len=self._kv_tokens(r))
            r.start, r.n = 0, len(r.prompt_ids)
            admitted.append(r)
        if not admitted:
            return
        whole = []
        for r in admitted:
            if self.prefill_chunk and r.n > self.prefill_chunk:
                # Its first job is attention + router of layer 0, in slices (``_run_slice``).
                ids = torch.tensor(r.prompt_ids, device=self.model.transformer.device)
                r.emb = self.model.transformer.embed(ids)
            else:
                whole.append(r)
        if whole:
            t0 = time.perf_counter()
            self.jobs.start(whole, [r.prompt_ids for r in whole])
            self.telemetry.record_compute(
                t0, time.perf_counter(), -1, tuple(r.id for r in whole), sum(r.n for r in whole)
            )
        self.running.extend(admitted)

    # --- schedule: claims and the compute group -----------------------------------------

    def _on_route(self, r: Request) -> None:
        self.cache.record_pass(r.layer)
        for e in r.needed:
            self.cache.record_use((r.layer, e))
        if self.prefetcher:
            self.prefetcher.observe(r)

    def _on_pass(self, r: Request, layer: int, needed: tuple[int, ...]) -> None:
        """``r`` went through ``layer`` in a walk (``JobRunner.run_through``): its routing,
        then its claim of those experts, all ready, as a job there counts them."""
        r.layer, r.needed = layer, needed
        self._on_route(r)
        for e in needed:
            self.cache.record_lookup((layer, e))

    def _missing(self, r: Request) -> int:
        return sum(1 for k in r.pending_keys(self.cache.n_slots) if not self.cache.is_present(k))

    def _claim(self) -> None:
        cache = self.cache
        blocked = [r for r in self.running if not r.claimed]
        if self.policy.group_size:
            allowed = self.policy.static_claimable(self.running)
            blocked = [r for r in blocked if id(r) in allowed]
        low = min((r.layer for r in self.running), default=0)
        if cache.policy == "reuse":
            # Every expert a request has routed to and not applied yet (a claimed one's
            # are pinned; a prompt's beyond its current chunk wait for the next).
            wanted = frozenset(
                (r.layer, e) for r in self.running for e in r.needed if e not in r.done
            )
            cache.set_positions([r.layer for r in self.running], self.model.config.n_layers, wanted)
        for r in self.policy.claim_order(blocked, self._missing, low):
            orders = self.claims.claim(r, r.pending_keys(cache.n_slots))
            if orders is None:
                break  # later claims wait too, so this job gets the next free slots
            priority = self.policy.fetch_priority(r, len(orders), self._tick)
            for k, slot in orders:
                self.fetcher.submit(priority, k, self.model.experts[k[0]][k[1]], slot)

    def _warm_more(self) -> None:
        """Queue the next warm-up reads: experts no request has brought in, unpinned."""
        cache = self.cache
        while self._warm and len(self._warming) < _WARM_QUEUED and not self._stopped:
            k = self._warm.popleft()
            if cache.is_present(k):
                continue
            # Only into a free slot: a warm-up read never evicts what requests brought in.
            slot = cache.reserve(k) if cache.n_used < cache.n_slots else None
            if slot is None:
                self._warm.clear()
                return
            cache.unpin(k)
            self._warming.add(k)
            self.fetcher.submit(_WARM_PRIORITY, k, self.model.experts[k[0]][k[1]], slot, True)

    def _ready(self, r: Request) -> bool:
        return r.claimed and all(self.cache.is_ready(k) for k in r.claim)

    def _schedule(self) -> list[Request] | Request:
        """The group whose job runs now, or a prompt whose next slice does."""
        self._tick += 1
        self._contended = False
        self._claim()
        if self.prefetcher:
            self.prefetcher.issue(self.fetcher, self.running)
        ready = []
        for r in self.running:
            if self._ready(r):
                if not r.ready_since:
                    r.ready_since = self._tick
                ready.append(r)
        together = self._held
        # Held together, a long prompt read in slices is not part of the batch: its slices
        # go beside it as before, never holding it up for a whole prefill.
        batch = [r for r in self.running if not self._sliced(r)] if together else self.running
        sliced = [r for r in self.running if self._sliced(r) and self._part_ready(r)]
        others = [r for r in ready if not self._sliced(r)]
        if not sliced:
            return self.policy.compute_group(batch, others, together)
        group = self.policy.compute_group(batch, others, together) if others else []
        return self._pick(min(sliced, key=progress), group)

    def _sliced(self, r: Request) -> bool:
        """Whether ``r`` is a long prompt read in parts (chunked prefill): its layer's MoE
        a few experts at a time for all of its rows (``JobRunner.apply``), then the rest
        of its job in slices of ``prefill_chunk`` rows (``JobRunner.run_rows``)."""
        return bool(self.prefill_chunk) and r.n > self.prefill_chunk  # decoding: n is 1

    def _part_ready(self, r: Request) -> bool:
        """Whether a long prompt's next part can run: a slice of rows (entering, or its
        layer's MoE done), or experts, once the first it has left is ready."""
        if r.entering or len(r.done) == len(r.needed):  # no experts: no claim to wait for
            return True
        return r.claimed and bool(r.claim) and self.cache.is_ready(r.claim[0])

    def _experts_part(self, r: Request) -> list[Ride]:
        """The next part of long prompts' MoE, led by ``r`` (``scheduler.prompt_part``):
        with it, the other long prompts at its layer with experts of theirs left."""
        others = [
            q
            for q in self.running
            if q is not r
            and q.layer == r.layer
            and self._sliced(q)
            and not q.entering
            and q.claimed
            and len(q.done) < len(q.needed)
        ]
        return prompt_part(
            r,
            others,
            self.cache.is_ready,
            lambda q: torch.bincount(q.route_ids.flatten()).tolist(),
            # a part costs about what a slice does, so chats between parts wait no longer
            self.prefill_chunk * r.route_ids.shape[1],
        )

    def _pick(self, prompt: Request, group: list[Request]) -> list[Request] | Request:
        """A slice of ``prompt`` or ``group``'s job: the slices get ``PREFILL_SHARE`` of
        the compute time while both wait, counted from when they began to."""
        if not group:  # the share is counted afresh when they next both wait
            self._slice_s = self._other_s = 0.0
            return prompt
        self._contended = True
        if self._slice_s * (1 - PREFILL_SHARE) <= self._other_s * PREFILL_SHARE:
            return prompt
        return group

    def _run_slice(self, r: Request) -> None:
        """The next part of a long prompt's job: some of its layer's experts (their pins
        released once applied), or a slice of rows; when its last row is done the
        request moves on as after a whole job (its first token sampled after the last
        layer)."""
        t0 = time.perf_counter()
        layer = -1 if r.entering else r.layer  # -1: before layer 0, as at admission
        part = None
        ids: tuple[str, ...] = (r.id,)
        if r.entering or len(r.done) == len(r.needed):
            rows = slice_end(r.row, self.prefill_chunk, r.n) - r.row
            logits = self.jobs.run_rows(r, self.prefill_chunk)
        else:
            part = self._experts_part(r)
            rows, logits = sum(q.n for q, _ in part), None
            ids = tuple(q.id for q, _ in part)
            self.jobs.apply(part)
        if self.slots.device.type == "cuda":  # as in ``_run``
            torch.cuda.current_stream(self.slots.device).synchronize()
        t1 = r.computed_at = time.perf_counter()
        for q, subset in part or ():  # applied: the link may reuse their slots
            self.claims.release(q, subset)
            q.computed_at = t1
        if self._contended:
            self._slice_s += t1 - t0
        # its layer done (``run_rows`` resets row) after its last slice of rows
        moved = part is None and (r.row == 0 or logits is not None)
        if moved:
            self.claims.release(r)
            r.ready_since = 0
        if logits is not None:
            if self.logits_log is not None:
                self.logits_log.setdefault(r.id, []).append(logits[0].clone())
            if self._postprocess(r, logits[0]):
                r.start, r.n = r.start + r.n, 1
                self.jobs.start([r], [[r.out_ids[-1]]])
        self.telemetry.record_compute(t0, time.perf_counter(), layer, ids, rows)

    def _run_split(self, part: list[Ride]) -> None:
        """Apply ``part``'s ready experts to their requests (as riders of an empty group),
        then release those experts' pins (each keeps its claim on the ones loading)."""
        t0 = time.perf_counter()
        layer = part[0][0].layer
        self.jobs.run([], part)  # none completes its layer: each still waits for one
        if self.slots.device.type == "cuda":  # as in ``_run``: before the link may reuse them
            torch.cuda.current_stream(self.slots.device).synchronize()
        t1 = time.perf_counter()
        for r, subset in part:
            self.claims.release(r, subset)
            r.computed_at = t1
        self.telemetry.record_compute(t0, t1, layer, tuple(r.id for r, _ in part), len(part))

    # --- run and postprocess ------------------------------------------------------------

    def _run(self, group: list[Request]) -> None:
        t0 = time.perf_counter()
        layer = group[0].layer
        ride = riders(self.running, group) if self.policy.ride else []
        for r, subset in ride:
            if not r.claimed:
                self.claims.ride((layer, e) for e in subset)
        # Nothing to overlap: every running request is in the group and the link is idle.
        # The group then walks on through the layers whose experts are all resident in one
        # native call, as its jobs would run one after another (no other job could come
        # between them), without the scheduling between them. A prefetcher guesses the
        # next layer's experts between jobs: it walks only where every expert fits.
        through = (
            not ride
            and len(group) == len(self.running)
            and self.cache.n_loading == len(self._warming)  # a walk stops at one not in
            and (self.prefetcher is None or self.cache.n_slots >= self._n_routed)
        )
        walked = self.jobs.run_through(group) if through else None
        done, logits = walked if walked is not None else self.jobs.run(group, ride)
        if self.slots.device.type == "cuda":
            # Kernels reading these slots may still be queued: finish them before the
            # link may overwrite an unpinned slot on its own stream.
            torch.cuda.current_stream(self.slots.device).synchronize()
        computed = time.perf_counter()
        for r in group:
            self.claims.release(r)
            r.ready_since = 0
            r.computed_at = computed
        for r, subset in ride:
            if r.claimed:  # what it rode on; all it held if that completed its layer
                self.claims.release(r, subset)
        continuing: list[Request] = []
        if logits is not None:
            if self.logits_log is not None:
                for r, row in zip(done, logits, strict=True):
                    self.logits_log.setdefault(r.id, []).append(row.clone())
            for r, row in zip(done, logits, strict=True):
                if self._postprocess(r, row):
                    continuing.append(r)
            if continuing:
                for r in continuing:
                    r.start, r.n = r.start + r.n, 1
                self.jobs.start(continuing, [[r.out_ids[-1]] for r in continuing])
        rows = [*group, *(r for r, _ in ride)]
        self.telemetry.record_compute(
            t0, time.perf_counter(), layer, tuple(r.id for r in rows), sum(r.n for r in rows)
        )

    def _postprocess(self, r: Request, logits: torch.Tensor) -> bool:
        """Sample, stream, check stops. Returns whether the request goes on."""
        if not r.out_ids and self.balancer is not None:
            self.balancer.changed(time.perf_counter())  # its prompt is read: decoding now
        tok = self.model.tokenizer
        allowed = None
        if r.grammar is not None and (allowed := r.grammar.allowed()) is None:
            self._emit(ErrorEvent(r.id, f"constrained decoding failed: {r.grammar.error}"))
            self._finish(r, "error")
            return False
        nxt = sample(logits, r.params, r.generator, r.prompt_ids + r.out_ids, allowed)
        if tok is not None and nxt in tok.eos_ids and not r.params.ignore_eos:
            self._finish(r, "stop")
            return False
        r.out_ids.append(nxt)
        self.telemetry.record_token(r.id)
        text = r.stops.feed(r.decoder.push(nxt)) if r.decoder is not None else ""
        r.text.append(text)
        self._emit(TokenEvent(r.id, nxt, text))
        if r.stops.stopped:
            self._finish(r, "stop")
            return False
        if r.grammar is not None and (not r.grammar.accept(nxt) or r.grammar.done):
            self._finish(r, "stop")  # the grammar admits nothing more
            return False
        if (
            len(r.out_ids) >= r.params.max_tokens
            or r.start + r.n + 1 >= self.model.config.context_length
        ):
            self._finish(r, "length")
            return False
        return True

    def _finish_by_id(self, request_id: str, reason: str) -> None:
        for r in list(self.running) + list(self.waiting):
            if r.id == request_id:
                self._finish(r, reason)
                return

    def _finish(self, r: Request, reason: str) -> None:
        if r.claimed:
            self.claims.release(r)
        if r.grammar is not None:
            r.grammar.close()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if reason != "abort" and r.decoder is not None and not r.stops.stopped:
            tail = r.stops.feed(r.decoder.flush()) + r.stops.flush()
            if tail:
                r.text.append(tail)
                self._emit(TokenEvent(r.id, -1, tail))
        r.status, r.finish_reason, r.kv, r.h, r.x, r.acc, r.parts = (
            RequestStatus.FINISHED,
            reason,
            None,
            None,
            None,
            None,
            {},
        )
        r.staged, r.emb = [], None
        self._ids.discard(r.id)
        self._trim_when_idle = True
        self._fit_cache(self._kv_held())
        if self.idle:
            # The last request out: its tokens are in the snapshot that pollers
            # (/v1/stats, the panels) hold before its end reaches the client.
            self._last_metrics = time.perf_counter()
            self._emit(self.snapshot(self._last_metrics))
        self._emit(
            Finished(
                r.id,
                reason,
                "".join(r.text),
                len(r.prompt_ids),
                len(r.out_ids),
                tuple(r.out_ids),
                r.dropped_messages,
                r.stops.matched if r.stops is not None and reason == "stop" else None,
            )
        )

    # --- events and metrics -------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        self.events.put(event)

    def _maybe_metrics(self) -> None:
        now = time.perf_counter()
        if self.balancer is not None and self.balancer.due(now):
            w = self.telemetry.window(self.balancer.window_start(now), now)
            self.balancer.update(
                now, w["link_busy_frac"], w["compute_busy_frac"], len(self.running)
            )
        if now - self._last_metrics >= self.config.metrics_interval_s:
            self._last_metrics = now
            self._emit(self.snapshot(now))

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds for the model now, by part, and the process's RSS."""
        return {
            "rss_bytes": rss_bytes(),
            "device_bytes": (
                torch.cuda.memory_reserved(self.slots.device)
                if self.slots.device.type == "cuda"
                else 0
            ),
            "cache_budget_bytes": self.cache_budget_bytes,
            "memory_budget_bytes": self.memory_plan.total_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "slots_bytes": self.cache.n_slots * self.slot_bytes,
            "working_set_bytes": self.jobs.experts.n_decoded * self._expert_bytes,
            "kv_bytes": sum(r.kv.nbytes for r in self.running if r.kv is not None),
            "dense_bytes": self._dense_bytes,
        }

    @property
    def compute_threads(self) -> int:
        """Threads the engine computes with now (``ComputePool``)."""
        return self.pool.threads if self.pool is not None else self._compute_threads

    @property
    def _held(self) -> bool:
        """Requests advance together (``balance``): no split runs either, since applying
        a waiting job's cached experts early is the same smaller-batch compute that
        holding them together saves."""
        return self.balancer is not None and self.balancer.together

    def runahead_state(self) -> str:
        if self.policy.lockstep:
            return "off"
        if self._held:
            return "held"
        need = sum(len(r.needed) for r in self.running)
        return "on" if need <= self.cache.n_slots else "limited"

    def snapshot(
        self, now: float | None = None, window_s: float = 2.0, lane_window_s: float = 6.0
    ) -> MetricsSnapshot:
        """Metrics over the last ``window_s``; lanes and residency for live views."""
        now = now or time.perf_counter()
        w = self.telemetry.window(now - window_s, now)
        link, comp = self.telemetry.merged_lanes(now - lane_window_s, now, origin=now)
        cache = self.cache
        resident = tuple(k for k, slot in cache.slot_of.items() if cache.ready[slot])
        n_layers = self.model.config.n_layers
        progress = []
        # Compute runs on this thread, so at a snapshot no job is running: a request is
        # "computing" when a job ran for it since the previous snapshot (the panels' view
        # of the last interval), else ready or waiting on what it holds now.
        since = self._snapshot_at
        self._snapshot_at = now
        for r in self.running:
            if r.computed_at > since:
                state = "computing"
            else:
                state = "ready" if self._ready(r) else "waiting"
            read = 1.0
            if not r.out_ids:
                passed = 0 if r.entering else r.layer + 1
                part = r.row / max(r.n, 1)
                if not r.entering and r.needed and self._sliced(r):  # its MoE, then its rows
                    part = (len(r.done) / len(r.needed) + part) / 2
                read = (passed + part) / (n_layers + 1)
            progress.append(
                RequestProgress(
                    r.id,
                    r.session,
                    r.layer,
                    n_layers,
                    state,
                    len(r.out_ids),
                    len(r.prompt_ids),
                    read,
                )
            )
        progress += [
            RequestProgress(r.id, r.session, 0, n_layers, "queued", 0, len(r.prompt_ids))
            for r in self.waiting
        ]
        return MetricsSnapshot(
            t=now,
            tokens_per_s=w["tokens_per_s"],
            hit_rate=self.cache.stats.hit_rate,
            both_busy_frac=w["both_busy_frac"],
            compute_wait_frac=w["compute_wait_frac"],
            compute_busy_frac=w["compute_busy_frac"],
            link_busy_frac=w["link_busy_frac"],
            fetched=self.cache.stats.fetches,
            cache_slots=self.cache.n_slots,
            cache_used=self.cache.n_used,
            cache_pinned=self.cache.n_pinned,
            runahead=self.runahead_state(),
            requests=tuple(progress),
            lane_window_s=lane_window_s,
            link_lane=tuple(link),
            compute_lane=tuple(comp),
            resident=resident,
            n_layers=n_layers,
            n_experts=self.model.config.n_experts,
            tokens_total=self.telemetry.n_tokens,
            expert_backend=self.expert_backend,
            compute_threads=self.compute_threads,
            compute_threads_max=self.pool.most if self.pool is not None else self._compute_threads,
            warm_left=0
            if self._warm_held
            else len(self._warming) + sum(not cache.is_present(k) for k in self._warm),
            **self.memory(),
        )
