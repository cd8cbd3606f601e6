"""Bevy's benchmark targets, checked against `bevy bench --json` output.

    bash benchmarks/sweep.sh OUT_DIR               # the sweeps below, then this script
    python benchmarks/targets.py OUT_DIR/*.json    # a table per file set, then the verdicts
    python benchmarks/targets.py --strict a.json   # exit status 1 if a target is missed

Each target compares policies measured side by side (interleaved in one invocation): one
configuration is (workload, requests, cache fraction, storage, device, eviction).

- ``bevy`` step time <= 1.15x max(compute busy, link busy), in every configuration;
- ``bevy`` >= 1.5x ``sync``'s decode tokens/s where ``sync``'s compute and link busy times
  are closest (the paper's best case; chosen per workload, storage, device and eviction),
  and > 1.0x everywhere;
- ``bevy`` >= 1.2x the best prefetch policy at 8 and 16 requests;
- ``bevy``'s fetched experts per step within 5 % of ``sync``'s;
- every policy's greedy tokens identical to plain generation's.

A configuration without the policies a target compares is left out of that target.
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


@dataclass(frozen=True)
class Verdict:
    target: str
    config: str  # the configuration it was checked at
    value: str  # what was measured there
    met: bool


def _config_key(r: dict) -> tuple:
    return (
        r["workload"],
        r["requests"],
        r["cache_fraction"],
        r["storage"],
        r["device"],
        r.get("eviction", "lfu"),
    )


def _name(key: tuple) -> str:
    w, n, c, storage, device, eviction = key
    return f"{w} {n} req, {c:.0%}, {storage}, {device}, {eviction}"


def configurations(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Records by configuration, then by policy. A policy measured twice in one
    configuration (two files) is an error: its runs were not side by side."""
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


def verdicts(records: list[dict]) -> list[Verdict]:
    configs = configurations(records)
    out: list[Verdict] = []
    for key, rows in configs.items():
        bevy, sync = rows.get("bevy"), rows.get("sync")
        if bevy is None:
            continue
        sb = bevy["step_over_bound"]
        beside = f" (sync {sync['step_over_bound']:.2f})" if sync else ""
        out.append(
            Verdict(
                f"step/bound <= {STEP_OVER_BOUND}",
                _name(key),
                f"{sb:.2f}{beside}",
                sb <= STEP_OVER_BOUND,
            )
        )
        if sync is not None:
            ratio = bevy["tokens_per_s"] / sync["tokens_per_s"]
            out.append(Verdict("> 1.0x sync", _name(key), f"{ratio:.2f}x", ratio > 1.0))
            extra = bevy["fetched_per_step"] / sync["fetched_per_step"] - 1
            out.append(
                Verdict(
                    f"fetched within {FETCHED_SLACK:.0%} of sync",
                    _name(key),
                    f"{bevy['fetched_per_step']:.1f} vs {sync['fetched_per_step']:.1f} "
                    f"({100 * extra:+.1f} %)",
                    extra <= FETCHED_SLACK,
                )
            )
        pf = _best_prefetch(rows)
        if pf is not None and key[1] in PREFETCH_REQUESTS:
            ratio = bevy["tokens_per_s"] / pf["tokens_per_s"]
            out.append(
                Verdict(
                    f">= {OVER_PREFETCH}x best prefetch at {'/'.join(map(str, PREFETCH_REQUESTS))} requests",
                    _name(key),
                    f"{ratio:.2f}x ({pf['policy']}, unused {100 * pf['unused_prefetch']:.0f} %)",
                    ratio >= OVER_PREFETCH,
                )
            )
        out.append(
            Verdict(
                "tokens identical to plain generation",
                _name(key),
                ", ".join(p for p, r in rows.items() if not r["tokens_identical_to_reference"])
                or "all policies",
                all(r["tokens_identical_to_reference"] for r in rows.values()),
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
            continue
        gap = abs(math.log(sync["compute_busy_s"] / sync["link_busy_s"]))
        group = (key[0], *key[3:])
        if group not in best or gap < best[group][0]:
            best[group] = (gap, key)
    for _, key in sorted(best.values(), key=lambda v: v[1]):
        bevy, sync = configs[key]["bevy"], configs[key]["sync"]
        ratio = bevy["tokens_per_s"] / sync["tokens_per_s"]
        out.append(
            Verdict(
                f">= {BEST_CASE_OVER_SYNC}x sync where sync's compute and link are closest",
                _name(key),
                f"{ratio:.2f}x (sync compute {sync['compute_busy_s']:.1f} s, "
                f"link {sync['link_busy_s']:.1f} s)",
                ratio >= BEST_CASE_OVER_SYNC,
            )
        )
    return out


def table(records: list[dict]) -> str:
    """One markdown row per configuration with bevy and sync in it."""
    lines = [
        "| config | bevy tok/s | sync | best prefetch | bevy/sync | bevy/best pf "
        "| bevy step/bound | sync step/bound | sync compute / link s | bevy compute / link s "
        "| fetched/step bevy vs sync | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, rows in configurations(records).items():
        b, s = rows.get("bevy"), rows.get("sync")
        if b is None or s is None:
            continue
        pf = _best_prefetch(rows)
        pf_cells = (
            (
                f"{pf['tokens_per_s']:.2f} ({pf['policy']})",
                f"{b['tokens_per_s'] / pf['tokens_per_s']:.2f}",
            )
            if pf
            else ("-", "-")
        )
        extra = 100 * (b["fetched_per_step"] / s["fetched_per_step"] - 1)
        exact = all(r["tokens_identical_to_reference"] for r in rows.values())
        lines.append(
            f"| {_name(key)} | {b['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} | {pf_cells[0]} "
            f"| {b['tokens_per_s'] / s['tokens_per_s']:.2f} | {pf_cells[1]} "
            f"| {b['step_over_bound']:.2f} | {s['step_over_bound']:.2f} "
            f"| {s['compute_busy_s']:.1f} / {s['link_busy_s']:.1f} "
            f"| {b['compute_busy_s']:.1f} / {b['link_busy_s']:.1f} "
            f"| {b['fetched_per_step']:.1f} vs {s['fetched_per_step']:.1f} ({extra:+.1f} %) "
            f"| {'yes' if exact else 'NO'} |"
        )
    return "\n".join(lines)


def report(records: list[dict]) -> tuple[str, bool]:
    """The table and the verdicts as text, and whether every target was met."""
    found = verdicts(records)
    lines = [table(records), ""]
    for v in found:
        lines.append(f"- {'met' if v.met else 'MISSED'}: {v.target} at {v.config}: {v.value}")
    missed = sum(not v.met for v in found)
    lines.append("")
    lines.append(f"{len(found) - missed} of {len(found)} checks met, {missed} missed.")
    return "\n".join(lines), missed == 0


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
