#!/usr/bin/env bash
# A/B of two source trees in one interleaved run: `bevy bench` from a checkout of REV,
# then from this tree, ROUNDS times, on the same demo MoE and the same Python; then each
# configuration's tokens/s from both, side by side (medians over rounds).
#
#   bash benchmarks/ab_trees.sh REV OUT_DIR            # e.g. REV=HEAD~3
#   ROUNDS=3 ARGS="--requests 8 --cache 0.3,0.7 --policies bevy,sync" bash benchmarks/ab_trees.sh REV OUT_DIR
#
# Run nothing else meanwhile: the two trees' figures are compared with each other.
set -euo pipefail
rev=${1:?usage: ab_trees.sh REV OUT_DIR}
out=${2:?usage: ab_trees.sh REV OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[[ $py == */* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
args=${ARGS:---workload chat --requests 8 --cache 0.3,0.7 --policies bevy,sync --tokens 64}
old=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
git -C "$root" worktree add --detach "$old" "$rev" >/dev/null
# The CLI module moved with the layout: run whichever this tree has.
cli() { if [ -f "$1/backend/serving/cli.py" ]; then echo backend.serving.cli; else echo backend.cli; fi; }
for round in $(seq "${ROUNDS:-2}"); do
    for side in old new; do
        dir=$root
        [ "$side" = old ] && dir=$old
        echo "== round $round, $side tree ($(date +%T))"
        # shellcheck disable=SC2086  # ARGS is a list of options
        (cd "$dir" && "$py" -m "$(cli "$dir")" bench $args --storage ssd \
            --json "$out/$side-$round.json" >"$out/$side-$round.log" 2>&1) ||
            { tail -20 "$out/$side-$round.log"; exit 1; }
    done
done
"$py" - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {"old": {}, "new": {}}
for f in sorted(out.glob("*-*.json")):
    side = f.stem.split("-")[0]
    for r in json.loads(f.read_text()):
        key = (r["workload"], r["requests"], r["cache_fraction"], r["policy"])
        runs[side].setdefault(key, []).append(r["tokens_per_s"])
print("| workload | requests | cache | policy | old tok/s | new tok/s | new/old |")
print("|---|---|---|---|---|---|---|")
for key in sorted(runs["new"]):
    o, n = runs["old"].get(key, []), runs["new"][key]
    mo, mn = (statistics.median(o) if o else float("nan")), statistics.median(n)
    w, req, c, p = key
    print(f"| {w} | {req} | {c:.0%} | {p} | {' / '.join(f'{x:.2f}' for x in o)} | "
          f"{' / '.join(f'{x:.2f}' for x in n)} | {mn / mo:.3f} |")
PY
