"""Bevy's benchmark targets, checked against `bevy bench --json` output.

    bash benchmarks/sweep.sh OUT_DIR               # the sweeps below, then this script
    python benchmarks/targets.py OUT_DIR/*.json    # one table, then a verdict per check
    python benchmarks/targets.py --strict a.json   # exit status 1 if a target is missed
                                                   # (or no configuration checks it)

Each target compares policies within one configuration (workload, requests, cache
fraction, storage, device, eviction), which must have been measured side by side
(interleaved in one `bevy bench` invocation, as sweep.sh runs them); mixing files that
measured the same configuration's policies apart is not detected.

- ``bevy`` step time <= 1.15x max(compute busy, link busy), in every configuration;
- ``bevy`` >= 1.5x ``sync``'s decode tokens/s where ``sync``'s compute and link busy times
  are closest (the paper's best case; chosen per workload, storage, device and eviction),
  and > 1.0x everywhere;
- ``bevy`` >= 1.2x the best prefetch policy at 8 and 16 requests (each prefetcher's unused
  fraction reported);
- ``bevy``'s fetched experts per step at most 5 % more than ``sync``'s (fewer is better);
- every policy's greedy tokens identical to plain generation's.

A configuration without the policies a target compares is left out of that target; a
target no configuration can check is reported as not checked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

STEP_OVER_BOUND = 1.15
BEST_CASE_OVER_SYNC = 1.5
OVER_PREFETCH = 1.2
PREFETCH_REQUESTS = (8, 16)
FETCHED_SLACK = 0.05


STEP = f"step/bound <= {STEP_OVER_BOUND}"
OVER_SYNC = "> 1.0x sync"
FETCHED = f"fetched per step at most {FETCHED_SLACK:.0%} more than sync's"
PREFETCH = (
    f">= {OVER_PREFETCH}x the best prefetcher at {'/'.join(map(str, PREFETCH_REQUESTS))} requests"
)
EXACT = "tokens identical to plain generation"
BEST_CASE = f">= {BEST_CASE_OVER_SYNC}x sync where sync's compute and link are closest"
TARGETS = (STEP, OVER_SYNC, FETCHED, PREFETCH, EXACT, BEST_CASE)


@dataclass(frozen=True)
class Verdict:
    target: str  # one of TARGETS
    config: str  # the configuration it was checked at
    value: str  # what was measured there
    met: bool | None  # None: no configuration in the records could check it


def _config_key(r: dict) -> tuple:
    return (
        r["workload"],
        r["requests"],
        r["cache_fraction"],
        r["storage"],
        r["device"],
        r.get("eviction", "unrecorded"),  # records from before bench named it
    )


def _name(key: tuple) -> str:
    w, n, c, storage, device, eviction = key
    return f"{w} {n} req, {c:.0%}, {storage}, {device}, {eviction}"


def configurations(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Records by configuration, then by policy. A policy twice in one configuration is
    an error: which of its figures to compare would be a guess."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows = out.setdefault(_config_key(r), {})
        if r["policy"] in rows:
            raise ValueError(f"{r['policy']} appears twice at {_name(_config_key(r))}")
        rows[r["policy"]] = r
    return dict(sorted(out.items()))


def _best_prefetch(rows: dict[str, dict]) -> dict | None:
    pf = [r for p, r in rows.items() if p.startswith("prefetch")]
    return max(pf, key=lambda r: r["tokens_per_s"]) if pf else None


def _unused(rows: dict[str, dict]) -> str:
    """Each prefetch policy's unused-prefetch fraction."""
    return ", ".join(
        f"{p} {100 * r['unused_prefetch']:.0f} %"
        for p, r in rows.items()
        if p.startswith("prefetch")
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _fetched_extra(bevy: dict, sync: dict) -> float:
    """bevy's fetched experts per step over sync's, minus 1 (0 if neither fetched)."""
    if sync["fetched_per_step"] <= 0:
        return 0.0 if bevy["fetched_per_step"] <= 0 else math.inf
    return bevy["fetched_per_step"] / sync["fetched_per_step"] - 1


def verdicts(records: list[dict]) -> list[Verdict]:
    """Every check the records allow, then one ``met=None`` verdict for each target none
    of their configurations could check."""
    configs = configurations(records)
    out: list[Verdict] = []
    for key, rows in configs.items():
        name = _name(key)
        bad = [p for p, r in rows.items() if not r["tokens_identical_to_reference"]]
        out.append(Verdict(EXACT, name, ", ".join(bad) or "all policies", not bad))
        bevy, sync = rows.get("bevy"), rows.get("sync")
        if bevy is None:
            continue
        sb = bevy["step_over_bound"]
        beside = f" (sync {sync['step_over_bound']:.2f})" if sync else ""
        out.append(Verdict(STEP, name, f"{sb:.2f}{beside}", sb <= STEP_OVER_BOUND))
        if sync is not None:
            ratio = _ratio(bevy["tokens_per_s"], sync["tokens_per_s"])
            out.append(Verdict(OVER_SYNC, name, f"{ratio:.2f}x", ratio > 1.0))
            extra = _fetched_extra(bevy, sync)
            out.append(
                Verdict(
                    FETCHED,
                    name,
                    f"{bevy['fetched_per_step']:.1f} vs {sync['fetched_per_step']:.1f} "
                    f"({100 * extra:+.1f} %)",
                    extra <= FETCHED_SLACK,
                )
            )
        pf = _best_prefetch(rows)
        if pf is not None and key[1] in PREFETCH_REQUESTS:
            ratio = _ratio(bevy["tokens_per_s"], pf["tokens_per_s"])
            out.append(
                Verdict(
                    PREFETCH,
                    name,
                    f"{ratio:.2f}x {pf['policy']} (unused prefetches: {_unused(rows)})",
                    ratio >= OVER_PREFETCH,
                )
            )
    # The best case: per workload (and storage, device, eviction), the configuration
    # where sync's compute and link busy times are closest, as a ratio.
    best: dict[tuple, tuple[float, tuple]] = {}
    for key, rows in configs.items():
        sync = rows.get("sync")
        if sync is None or "bevy" not in rows:
            continue
        if sync["compute_busy_s"] <= 0 or sync["link_busy_s"] <= 0:
            continue  # nothing fetched (or computed): no balance to speak of
        gap = abs(math.log(sync["compute_busy_s"] / sync["link_busy_s"]))
        group = (key[0], *key[3:])
        if group not in best or gap < best[group][0]:
            best[group] = (gap, key)
    for _, key in sorted(best.values(), key=lambda v: v[1]):
        bevy, sync = configs[key]["bevy"], configs[key]["sync"]
        ratio = _ratio(bevy["tokens_per_s"], sync["tokens_per_s"])
        out.append(
            Verdict(
                BEST_CASE,
                _name(key),
                f"{ratio:.2f}x (sync compute {sync['compute_busy_s']:.1f} s, "
                f"link {sync['link_busy_s']:.1f} s)",
                ratio >= BEST_CASE_OVER_SYNC,
            )
        )
    checked = {v.target for v in out}
    out += [
        Verdict(t, "-", "no configuration here checks it", None)
        for t in TARGETS
        if t not in checked
    ]
    return out


def table(records: list[dict]) -> str:
    """One markdown row per configuration with bevy and sync in it."""
    lines = [
        "| config | bevy tok/s | sync | best prefetch | bevy/sync | bevy/best pf "
        "| bevy step/bound | sync step/bound | sync compute / link s | bevy compute / link s "
        "| fetched/step bevy vs sync | unused prefetches | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, rows in configurations(records).items():
        b, s = rows.get("bevy"), rows.get("sync")
        if b is None or s is None:
            continue
        pf = _best_prefetch(rows)
        pf_cells = (
            (
                f"{pf['tokens_per_s']:.2f} ({pf['policy']})",
                f"{_ratio(b['tokens_per_s'], pf['tokens_per_s']):.2f}",
            )
            if pf
            else ("-", "-")
        )
        extra = 100 * _fetched_extra(b, s)
        exact = all(r["tokens_identical_to_reference"] for r in rows.values())
        lines.append(
            f"| {_name(key)} | {b['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} | {pf_cells[0]} "
            f"| {_ratio(b['tokens_per_s'], s['tokens_per_s']):.2f} | {pf_cells[1]} "
            f"| {b['step_over_bound']:.2f} | {s['step_over_bound']:.2f} "
            f"| {s['compute_busy_s']:.1f} / {s['link_busy_s']:.1f} "
            f"| {b['compute_busy_s']:.1f} / {b['link_busy_s']:.1f} "
            f"| {b['fetched_per_step']:.1f} vs {s['fetched_per_step']:.1f} ({extra:+.1f} %) "
            f"| {_unused(rows) or '-'} | {'yes' if exact else 'NO'} |"
        )
    return "\n".join(lines)


def report(records: list[dict]) -> tuple[str, bool]:
    """The table and the verdicts as text, and whether every target was checked and met."""
    found = verdicts(records)
    lines = [table(records), ""]
    word = {True: "met", False: "MISSED", None: "NOT CHECKED"}
    for v in found:
        lines.append(f"- {word[v.met]}: {v.target} at {v.config}: {v.value}")
    met = sum(v.met is True for v in found)
    missed = sum(v.met is False for v in found)
    unchecked = sum(v.met is None for v in found)
    lines.append("")
    lines.append(
        f"{met} of {met + missed} checks met, {missed} missed; {unchecked} targets not checked."
    )
    return "\n".join(lines), missed == 0 and unchecked == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="`bevy bench --json` files")
    ap.add_argument(
        "--strict", action="store_true", help="exit with status 1 if a target is missed"
    )
    args = ap.parse_args(argv)
    records = []
    for f in args.files:
        try:
            records += json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            print(f"cannot read {f}: {exc}", file=sys.stderr)
            return 2
    try:
        text, ok = report(records)
    except (KeyError, ValueError) as exc:
        print(f"not bench records: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
