#!/usr/bin/env bash
# The checks that need an NVIDIA GPU: tests/gpu, then `bevy bench` on CUDA with the host tier
# (experts in pinned RAM, copied over PCIe on the link's own stream), the paper's GPU setting.
#
#   benchmarks/cuda.sh tests OUTDIR     pytest tests/gpu            -> OUTDIR/gpu_tests.log
#   benchmarks/cuda.sh bench OUTDIR     builds the demo MoE if needed, then bench sweeps
#                                       -> OUTDIR/cuda_bench.log, OUTDIR/cuda_*.json
#
# Runs with whatever python3 holds a CUDA torch (the project's own .venv is CPU-only). Extra
# wheels the machine lacks can wait in $BEVY_WHEELS (installed with --no-deps into /tmp/site).
# Each bench invocation is capped by $BEVY_BENCH_LIMIT seconds (default 150) so a slow one
# cannot eat the others' time; the JSON of every invocation that finished is kept.
# $BEVY_BENCH_CONFIGS ("workload requests caches" separated by ';'), $BEVY_BENCH_TOKENS
# (default 64) and $BEVY_SLOT_FORMATS (space-separated, default "auto") narrow or widen
# the sweep to fit the device time at hand.
set -u
stage=${1:?"usage: $0 tests|bench OUTDIR"}
out=${2:?"usage: $0 tests|bench OUTDIR"}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [ -n "${BEVY_WHEELS:-}" ] && ls "$BEVY_WHEELS"/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$BEVY_WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

"$py" - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0), flush=True)
EOF

case "$stage" in
tests)
    "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu 2>&1 | tee "$out/gpu_tests.log"
    exit "${PIPESTATUS[0]}"
    ;;
bench)
    "$py" -c 'from backend.demo.build import ensure_demo; print(ensure_demo())' || exit 1
    limit=${BEVY_BENCH_LIMIT:-150}
    policies=bevy,sync,prefetch-gate,prefetch-history
    n=0
    # Most telling first: the balanced region at 8 requests, then more requests, then agents.
    configs=${BEVY_BENCH_CONFIGS:-"chat 8 0.1,0.3;chat 16 0.3;agentic 8 0.3"}
    IFS=';' read -ra cfgs <<<"$configs"
    for fmt in ${BEVY_SLOT_FORMATS:-auto}; do
        for cfg in "${cfgs[@]}"; do
            set -- $cfg
            n=$((n + 1))
            echo "== bench $cfg, slots $fmt" | tee -a "$out/cuda_bench.log"
            timeout "$limit" "$py" -m backend.serving.cli bench --device cuda --storage host \
                --policies "$policies" --workload "$1" --requests "$2" --cache "$3" \
                --tokens "${BEVY_BENCH_TOKENS:-64}" --slot-format "$fmt" \
                --json "$out/cuda_$n.json" 2>&1 | tee -a "$out/cuda_bench.log"
        done
    done
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
