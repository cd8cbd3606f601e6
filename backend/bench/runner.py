"""``bevy bench``: policies side by side on the same model, prompts and machine.

Policies run interleaved (A B C A B C ...) so drift of the machine cancels. Each run
starts a fresh engine (cold cache), submits N prompts at once, and measures the decode
phase: from the moment every request has its first token to the last token.
Every run's tokens are checked against plain in-memory greedy decoding.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backend.bench.workloads import load_workload
from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine, short_switch_interval
from backend.engine.memory import trim_heap
from backend.engine.pool import sized_team
from backend.errors import BevyError
from backend.messages import ErrorEvent, MetricsSnapshot, Submit, TokenEvent
from backend.models.generate import chat_prompt_ids, greedy_reference
from backend.models.loader import LoadedModel
from backend.models.transformer import GetExpert

SLOT_NOTES = {
    "stored": "A cache slot holds one expert's stored (quantized) bytes. Compute reads them directly (a fused kernel for Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 experts with few rows, on the CPU) or dequantizes them on use; either way it is counted as compute time.",
    "decoded": "A cache slot holds one expert's weights dequantized to the compute dtype; dequantization happens once per fetch and is counted as link time.",
}
MEMORY_NOTE = (
    "peak MiB: the process's resident set at its highest during the run (the loaded model "
    "and the runtime included, not what the reference or earlier runs read and freed; "
    "JSON also has peak_engine_mib, what the engine held)."
)
RATE_NOTE = (
    "tok/s: decoding, from the moment every request has its first token; all tok/s: "
    "every token over the whole run, prompts included (the same work for every policy). "
    "rows/run: the tokens each compute run multiplied while decoding (its group's and "
    "riders'), on average."
)
LINK_NOTE = "Link time: the read from the store (O_DIRECT from the model file for --storage ssd, a RAM copy for host), the decode if any, and the copy to the device on CUDA. link CPU ms: the link thread's CPU time per fetch, which on few cores compute does not get. A paced link (--link-rate) lands each expert no sooner than a link of that speed would carry it."


# How often a run reads the engine's memory for its peaks (seconds): what a prompt holds
# while it is read (its activations, its KV) stays for its whole prefill, far longer.
MEMORY_EVERY_S = 0.025


@dataclass(frozen=True)
class BenchPlan:
    policies: tuple[str, ...] = ("bevy", "sync", "prefetch-gate", "prefetch-history")
    workloads: tuple[str, ...] = ("chat",)
    requests: tuple[int, ...] = (8,)
    caches: tuple[float, ...] = (0.3,)
    tokens: int = 64
    storage: str = "ssd"
    device: str = "cpu"
    repeats: int = 1
    eviction: str = "lfu"
    slot_format: str = "auto"
    expert_backend: str = "auto"
    working_set_mib: int = 0  # decoded experts kept, out of each cache fraction's budget
    kv_type: str = "auto"  # how the KV cache stores keys and values (EngineConfig.kv_type)
    link_rate: int = 0  # bytes a second of a paced link (EngineConfig.link_rate); 0: none
    keep_lanes: bool = False  # records carry each lane's busy intervals (compare view)
    # The engine builds its live snapshots (the panels', /v1/stats) as it serves; off, the
    # policies are compared without that cost, which each pays by its own events.
    live_metrics: bool = False


def prompts_for(model: LoadedModel, workload: str, n: int) -> list[list[int]]:
    records = load_workload(workload)
    return [
        chat_prompt_ids(
            model, records[i % len(records)]["messages"], records[i % len(records)].get("tools")
        )
        for i in range(n)
    ]


def run_once(
    model: LoadedModel,
    policy: str,
    prompts: list[list[int]],
    cache: float,
    plan: BenchPlan,
    trace: Path | None = None,
) -> dict:
    cfg = EngineConfig(
        device=plan.device,
        storage=plan.storage,
        cache=str(cache),
        eviction=plan.eviction,
        policy=policy,
        max_active=len(prompts),
        kv_budget_mib=1 << 16,
        # Policies are compared on the reads their requests need: no warm-up reads in the
        # link's figures (a 100 % cache would otherwise read every expert meanwhile).
        warm=False,
        metrics_interval_s=EngineConfig.metrics_interval_s if plan.live_metrics else 3600,
        slot_format=plan.slot_format,
        expert_backend=plan.expert_backend,
        working_set_mib=plan.working_set_mib,
        kv_type=plan.kv_type,
        link_rate=plan.link_rate,
    )
    # Each run's peak is its own: what the plain-generation reference or an earlier run
    # read from the mapped file, and freed heap the C library keeps, leave the process.
    model.files.release()
    trim_heap()
    eng = Engine(model, cfg)
    short_switch_interval()  # as the engine thread runs in the app and `bevy serve`
    params = SamplingParams(temperature=0.0, max_tokens=plan.tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(Submit(f"b{i}", params, prompt_ids=p))
    try:
        tokens: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
        mark = None
        t_start = time.perf_counter()
        peak_rss = peak_engine = 0
        sampled = 0.0
        first_at: list[float] = []  # seconds from submission to each request's first token
        snapshots = 0
        while eng.has_work:
            eng.step()
            # Memory read every MEMORY_EVERY_S, not every few steps: each read (the RSS and
            # every request's KV) then takes the same share of every policy's time.
            if (now := time.perf_counter()) - sampled >= MEMORY_EVERY_S:
                sampled = now
                mem = eng.memory()
                peak_rss = max(peak_rss, mem["rss_bytes"])
                held = mem["slots_bytes"] + mem["working_set_bytes"] + mem["kv_bytes"]
                peak_engine = max(peak_engine, held + mem["dense_bytes"])
            while not eng.events.empty():
                ev = eng.events.get()
                if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    if not tokens[ev.request_id]:
                        first_at.append(time.perf_counter() - t_start)
                    tokens[ev.request_id].append(ev.token_id)
                elif isinstance(ev, MetricsSnapshot):
                    snapshots += 1
                elif isinstance(ev, ErrorEvent):
                    raise BevyError(f"bench request {ev.request_id} failed: {ev.message}")
            if mark is None and all(tokens.values()):
                s = eng.cache.stats
                mark = (
                    time.perf_counter(),
                    s.hits,
                    s.misses,
                    eng.telemetry.fetched,
                    sum(len(t) for t in tokens.values()),
                    eng.fetcher.cpu_s(),
                )
    except BaseException:
        eng.close()
        raise
    t_end = time.perf_counter()
    link_cpu = eng.fetcher.cpu_s()
    assert mark is not None
    t0, hits0, misses0, fetched0, tok0, link_cpu0 = mark
    fetched = eng.telemetry.fetched - fetched0
    window = eng.telemetry.window(t0, t_end)
    # The compute runs in the window, and the rows (a decoding request's token) in each:
    # how large the groups the policy formed were, riders included.
    runs = eng.telemetry.compute.copy()
    rows = runs.columns["tokens"][(runs.start >= t0) & (runs.start < t_end)]
    n_decode = sum(len(t) for t in tokens.values()) - tok0
    steps = n_decode / len(prompts)
    s = eng.cache.stats
    lookups = (s.hits - hits0) + (s.misses - misses0)
    record = {
        "policy": policy,
        "tokens_per_s": n_decode / window["wall_s"],
        "compute_busy_s": window["compute_busy_s"],
        "link_busy_s": window["link_busy_s"],
        "wall_s": window["wall_s"],
        "both_busy_frac": window["both_busy_frac"],
        "compute_wait_frac": window["compute_wait_frac"],
        "fetched_per_step": fetched / steps if steps else 0.0,
        "compute_runs": int(rows.size),
        "rows_per_run": float(rows.mean()) if rows.size else 0.0,
        "link_cpu_ms_per_fetch": None
        if link_cpu is None or link_cpu0 is None or not fetched
        else 1000 * (link_cpu - link_cpu0) / fetched,
        "hit_rate": (s.hits - hits0) / lookups if lookups else 0.0,
        "unused_prefetch": eng.prefetcher.unused_fraction() if eng.prefetcher else 0.0,
        "step_over_bound": window["wall_s"]
        / max(window["compute_busy_s"], window["link_busy_s"], 1e-9),
        "prefill_s": t0 - t_start,
        "snapshots": snapshots,  # live snapshots the engine built in the whole run
        # The compute team at the run's end and how often its size changed (fewer threads
        # while other processes keep CPUs busy: backend/engine/pool.py).
        "compute_threads": eng.compute_threads,
        "pool_changes": eng.pool.changes if eng.pool is not None else 0,
        "first_token_p50_s": statistics.median(first_at),
        # Every token over the whole run, prompts included: runs whose requests reach
        # their first tokens at different times are measured over the same work.
        "overall_tokens_per_s": sum(len(t) for t in tokens.values()) / (t_end - t_start),
        "cache_slots": eng.cache.n_slots,
        # The process's peak resident set while this configuration ran (the loaded model
        # and the Python runtime included), and the peak of what the engine itself held:
        # cache slots, decoded working set, KV and dense weights.
        "peak_rss_mib": peak_rss / 2**20,
        "peak_engine_mib": peak_engine / 2**20,
        "cache_budget_mib": eng.cache_budget_bytes / 2**20,
        "slot_format": eng.slot_format,
        "expert_backend": eng.expert_backend,
        "tokens": [tokens[f"b{i}"] for i in range(len(prompts))],
    }
    if plan.keep_lanes:
        link, comp = eng.telemetry.merged_lanes(t0, t_end)
        rel = lambda lane: [(s - t0, e - t0) for s, e in lane]  # noqa: E731
        record["lanes"] = {"link": rel(link), "compute": rel(comp)}
    if trace is not None:
        eng.telemetry.write_chrome_trace(trace)
    eng.close()
    return record


class BenchCancelled(BevyError):
    """The comparison was cancelled between two of its runs."""


def _reference(
    model: LoadedModel,
    prompts: list[list[int]],
    tokens: int,
    get_expert: GetExpert | None = None,
) -> list[list[int]]:
    """``greedy_reference`` on the team a busy machine leaves (``sized_team``)."""
    with sized_team(model.transformer.device.type == "cpu") as resize:
        return greedy_reference(model, prompts, tokens, get_expert, resize)


def run_bench(
    model: LoadedModel,
    plan: BenchPlan,
    trace: Path | None = None,
    log=print,
    progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[dict]:
    """Each policy over each configuration, ``plan.repeats`` times. ``progress`` hears
    (steps done, steps in all) — the reference decodes, then the runs; ``cancel``, once
    set, stops it before its next step (BenchCancelled)."""
    configs = [(w, n, c) for w in plan.workloads for n in plan.requests for c in plan.caches]
    results: dict[tuple, list[dict]] = {}
    references: dict[tuple, list[list[int]]] = {}
    prompts: dict[tuple, list[list[int]]] = {}
    n_refs = len({(w, n) for w, n, _ in configs})
    total = n_refs + plan.repeats * len(configs) * len(plan.policies)
    done = 0

    def step() -> None:
        nonlocal done
        if cancel is not None and cancel.is_set():
            raise BenchCancelled("cancelled")
        if progress is not None:
            progress(done, total)
        done += 1

    # The references store keys and values as the runs' engines do.
    model.transformer.set_kv_type(plan.kv_type)
    for w, n, _ in configs:
        if (w, n) not in prompts:
            step()
            prompts[(w, n)] = prompts_for(model, w, n)
            log(f"reference: plain greedy decoding of {n} {w} prompts ({plan.tokens} tokens) ...")
            references[(w, n)] = _reference(model, prompts[(w, n)], plan.tokens)
    for rep in range(plan.repeats):
        for w, n, c in configs:
            for policy in plan.policies:
                t = None
                if trace is not None and rep == 0 and (w, n, c) == configs[0]:
                    t = trace.with_name(
                        f"{trace.stem}.{policy.replace(':', '_')}{trace.suffix or '.json'}"
                    )
                step()
                log(
                    f"[{rep + 1}/{plan.repeats}] {w} x{n} cache {c:.0%} {plan.storage}: {policy} ..."
                )
                rec = run_once(model, policy, prompts[(w, n)], c, plan, t)
                # On the CPU the reference multiplies as the native backend does (its Q4
                # experts' inputs rounded to 8 bits); the other backends multiply in float.
                as_ref = rec["expert_backend"] == "native" or model.transformer.device.type != "cpu"
                key = (w, n) if as_ref else (w, n, "float")
                if key not in references:
                    log("reference: the same, the experts dequantized, as that backend ...")
                    dequantized = model.resident_experts().for_compute
                    references[key] = _reference(model, prompts[(w, n)], plan.tokens, dequantized)
                rec["tokens_identical_to_reference"] = rec.pop("tokens") == references[key]
                results.setdefault((w, n, c, policy), []).append(rec)
    if progress is not None:
        progress(total, total)
    records = []
    for (w, n, c, policy), runs in results.items():
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in runs[0]
            if isinstance(runs[0][k], float | int) and not isinstance(runs[0][k], bool)
        }
        records.append(
            {
                "policy": policy,
                "workload": w,
                "requests": n,
                "cache_fraction": c,
                "storage": plan.storage,
                "device": plan.device,
                "eviction": plan.eviction,
                "link_rate": plan.link_rate,
                "live_metrics": plan.live_metrics,
                **med,
                "slot_format": runs[0]["slot_format"],
                "expert_backend": runs[0]["expert_backend"],
                "tokens_identical_to_reference": all(
                    r["tokens_identical_to_reference"] for r in runs
                ),
                "repeats": len(runs),
                **({"lanes": runs[0]["lanes"]} if plan.keep_lanes else {}),
            }
        )
    _add_ratios(records)
    return records


def _add_ratios(records: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["requests"], r["cache_fraction"]), []).append(r)
    for rows in groups.values():
        for key, ratio in (
            ("tokens_per_s", "ratio_to_sync"),
            ("overall_tokens_per_s", "overall_ratio_to_sync"),
        ):
            sync = next((r[key] for r in rows if r["policy"] == "sync"), None)
            for r in rows:
                r[ratio] = r[key] / sync if sync else None
        prefetch = [r["tokens_per_s"] for r in rows if r["policy"].startswith("prefetch")]
        for r in rows:
            r["ratio_to_best_prefetch"] = r["tokens_per_s"] / max(prefetch) if prefetch else None


def format_tables(records: list[dict]) -> str:
    formats = sorted({r.get("slot_format", "stored") for r in records})
    out = [SLOT_NOTES[f] for f in formats] + [RATE_NOTE, LINK_NOTE, MEMORY_NOTE, ""]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(
            (
                r["workload"],
                r["requests"],
                r["cache_fraction"],
                r["storage"],
                r["device"],
                r.get("link_rate", 0),
                r.get("live_metrics", False),
            ),
            [],
        ).append(r)
    head = (
        "policy",
        "experts",
        "tok/s",
        "x sync",
        "x best pf",
        "all tok/s",
        "all x sync",
        "compute s",
        "link s",
        "link CPU ms",
        "both %",
        "wait %",
        "fetch/step",
        "rows/run",
        "hit %",
        "unused pf %",
        "step/bound",
        "peak MiB",
        "exact",
    )
    for (w, n, c, st, dev, rate, live), rows in groups.items():
        paced = f", link paced to {rate / 1e9:.2f} GB/s" if rate else ""
        paced += ", live metrics" if live else ""
        out.append(f"## {w}, {n} requests, cache {c:.0%}, storage {st}, device {dev}{paced}")
        table = [head]
        for r in rows:
            ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            table.append(
                (
                    r["policy"],
                    r.get("expert_backend", "?"),
                    f"{r['tokens_per_s']:.2f}",
                    ratio(r["ratio_to_sync"]),
                    ratio(r["ratio_to_best_prefetch"]),
                    f"{r['overall_tokens_per_s']:.2f}",
                    ratio(r["overall_ratio_to_sync"]),
                    f"{r['compute_busy_s']:.1f}",
                    f"{r['link_busy_s']:.1f}",
                    ratio(r.get("link_cpu_ms_per_fetch")),
                    f"{100 * r['both_busy_frac']:.0f}",
                    f"{100 * r['compute_wait_frac']:.0f}",
                    f"{r['fetched_per_step']:.1f}",
                    f"{r.get('rows_per_run', 0):.2f}",
                    f"{100 * r['hit_rate']:.0f}",
                    f"{100 * r['unused_prefetch']:.0f}"
                    if r["policy"].startswith("prefetch") or "prefetch" in r["policy"]
                    else "-",
                    f"{r['step_over_bound']:.2f}",
                    f"{r.get('peak_rss_mib', 0):.0f}",
                    "yes" if r["tokens_identical_to_reference"] else "NO",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        out += [
            "  ".join(
                v.rjust(wd) if i else v.ljust(wd)
                for i, (v, wd) in enumerate(zip(row, widths, strict=True))
            )
            for row in table
        ]
        out.append("")
    return "\n".join(out)


def write_json(records: list[dict], path: Path) -> None:
    path.write_text(json.dumps(records, indent=1))


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "bevy bench: --plot needs matplotlib (pip install 'bevy-desktop[bench]')",
            file=sys.stderr,
        )
        return
    labels = sorted({(r["workload"], r["requests"], r["cache_fraction"]) for r in records})
    policies = sorted({r["policy"] for r in records})
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.4), 4))
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        ys = [
            next(
                (
                    r["tokens_per_s"]
                    for r in records
                    if r["policy"] == p
                    and (r["workload"], r["requests"], r["cache_fraction"]) == lab
                ),
                0,
            )
            for lab in labels
        ]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=p)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(labels))],
        [f"{w}\nx{n} {c:.0%}" for w, n, c in labels],
    )
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
