#!/usr/bin/env bash
# The sweeps Bevy's targets are stated for (see benchmarks/targets.py), on the demo MoE:
# requests 2, 4, 8, 16 at 30 % cache and cache 10-70 % at 8 requests, chat and agentic
# workloads, `sync`, `bevy` and both prefetchers interleaved in each invocation, 64 decode
# tokens per request, experts read from the SSD. Then the targets' table and verdicts.
#
#   bash benchmarks/sweep.sh OUT_DIR            # about 70 minutes on a 2-core CPU
#   EXTRA="--eviction reuse" TOKENS=32 bash benchmarks/sweep.sh OUT_DIR
#
# Run nothing else meanwhile: the policies' figures are compared with each other.
set -euo pipefail
out=${1:?usage: sweep.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd) # the runs below work from the repository root
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[[ $py == */* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
policies=${POLICIES:-bevy,sync,prefetch-gate,prefetch-history}
tokens=${TOKENS:-64}
names=()
cd "$root"
run() {
    local name=$1
    shift
    names+=("$out/$name.json")
    echo "== $name: $* ($(date +%T))"
    # shellcheck disable=SC2086  # EXTRA is a list of options
    "$py" -m backend.serving.cli bench --policies "$policies" --tokens "$tokens" --storage ssd \
        "$@" ${EXTRA:-} --json "$out/$name.json" >"$out/$name.log" 2>&1 ||
        { tail -20 "$out/$name.log"; exit 1; }
}
for w in chat agentic; do
    run "$w-requests" --workload "$w" --requests 2,4,16 --cache 0.3
    run "$w-cache" --workload "$w" --requests 8 --cache 0.1,0.3,0.5,0.7
done
echo "== done ($(date +%T))"
"$py" benchmarks/targets.py "${names[@]}" | tee "$out/targets.md"
