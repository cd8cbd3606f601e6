"""What the engine's process holds in memory, step by step, on one model.

    python benchmarks/resident_memory.py [--model GGUF] [--cache 0.3] [--prompt-tokens 1200]

Prints the process's anonymous resident memory (``RssAnon``: what no file backs) after
importing the engine, after loading the model, after starting an engine, and the peak
(sampled every millisecond) while that engine reads one long prompt (the first bundled
agentic conversation, cut to ``--prompt-tokens``) and writes one token; then the dense
weights as held, the cache slots' budget, and whether Inductor was ever imported.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo MoE)")
    ap.add_argument("--cache", default="0.3")
    ap.add_argument("--prompt-tokens", type=int, default=1200)
    args = ap.parse_args()

    from backend.bench.workloads import load_workload
    from backend.config import EngineConfig, SamplingParams
    from backend.demo.build import ensure_demo
    from backend.engine.loop import Engine
    from backend.messages import Submit
    from backend.models.loader import load_model

    print(f"imported          {anon_mib():7.0f} MiB")
    model = load_model(args.model or ensure_demo(quiet=True))
    print(f"model loaded      {anon_mib():7.0f} MiB")
    eng = Engine(model, EngineConfig(policy="bevy", cache=args.cache))
    print(f"engine started    {anon_mib():7.0f} MiB")
    record = load_workload("agentic")[0]
    text = "\n".join(str(m.get("content")) for m in record["messages"])
    ids = model.tokenizer.encode(text)[: args.prompt_tokens]
    peak, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.submit(Submit("prompt", params, prompt_ids=ids))
    eng.run_until_idle(3600)
    done.set()
    watcher.join()
    print(f"peak, {len(ids)}-token prompt {peak[0]:7.0f} MiB")
    print(f"dense weights held {model.transformer.held_bytes() / 2**20:6.0f} MiB")
    print(f"cache slots budget {eng.cache_budget_bytes / 2**20:6.0f} MiB")
    print(f"Inductor imported: {'torch._inductor' in sys.modules}")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
