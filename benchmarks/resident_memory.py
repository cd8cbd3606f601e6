"""What the engine's process holds in memory, step by step, on one model.

    python benchmarks/resident_memory.py [--model GGUF] [--cache 0.3] [--prompt-tokens 1200]
        [--memory 1100MiB --chats 8] [--device cuda]

Prints the process's anonymous resident memory (``RssAnon``: what no file backs) after
importing the engine, after loading the model, after starting an engine, and the peak
(sampled every millisecond) while that engine reads one long prompt (the first bundled
agentic conversation, cut to ``--prompt-tokens``) and writes one token; then the dense
weights as held, the cache slots' budget, and whether Inductor was ever imported.

With ``--memory`` (the engine's whole budget, its cache "auto") it prints the plan, and
the peak whole resident set (``rss_bytes``: file-backed pages too, what the budget
counts) against it; ``--chats N`` first decodes N bundled chats (64 tokens each), then
reads the prompt beside N/2 more.

With ``--device cuda`` (experts in pinned RAM, ``--storage host``) the budget is the
GPU's: it prints the allocator's peak (allocated and reserved) and the device memory in
use at the end (the CUDA context included) against it.
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
    ap.add_argument("--memory", default="", help="a total budget instead of --cache")
    ap.add_argument("--chats", type=int, default=0, help="chats decoded before and beside")
    ap.add_argument("--prompt-tokens", type=int, default=1200)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()

    from backend.bench.workloads import load_workload
    from backend.config import EngineConfig, SamplingParams
    from backend.demo.build import ensure_demo
    from backend.engine.loop import Engine
    from backend.engine.memory import rss_bytes
    from backend.messages import Submit
    from backend.models.loader import load_model

    print(f"imported          {anon_mib():7.0f} MiB")
    cuda = args.device == "cuda"
    model = load_model(args.model or ensure_demo(quiet=True), device=args.device)
    print(f"model loaded      {anon_mib():7.0f} MiB")
    cache = "auto" if args.memory else args.cache
    storage = "host" if cuda else "ssd"
    eng = Engine(
        model,
        EngineConfig(
            policy="bevy", cache=cache, memory=args.memory, device=args.device, storage=storage
        ),
    )
    print(f"engine started    {anon_mib():7.0f} MiB (resident {rss_bytes() >> 20} MiB)")
    print(f"plan: {eng.memory_plan.note}, KV budget {eng.kv_budget_bytes >> 20} MiB")
    record = load_workload("agentic")[0]
    text = "\n".join(str(m.get("content")) for m in record["messages"])
    ids = model.tokenizer.encode(text)[: args.prompt_tokens]
    peak, whole, done = [0.0], [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            whole[0] = max(whole[0], rss_bytes())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    chats = load_workload("chat")[: args.chats]
    talk = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, rec in enumerate(chats):
        eng.submit(Submit(f"chat{i}", talk, messages=rec["messages"]))
    eng.run_until_idle(3600)
    if chats:
        print(f"peak, {len(chats)} chats    {whole[0] >> 20:7d} MiB resident")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.submit(Submit("prompt", params, prompt_ids=ids))
    for i, rec in enumerate(chats[: len(chats) // 2]):
        eng.submit(Submit(f"beside{i}", talk, messages=rec["messages"]))
    eng.run_until_idle(3600)
    done.set()
    watcher.join()
    print(f"peak, {len(ids)}-token prompt {peak[0]:7.0f} MiB")
    budget = f" of a {eng.memory_plan.total_bytes >> 20} MiB budget" if args.memory else ""
    # On CUDA the budget is the device's; the host's resident set holds the pinned experts.
    print(f"peak resident      {whole[0] >> 20:6d} MiB{'' if cuda else budget}")
    print(f"dense weights held {model.transformer.held_bytes() / 2**20:6.0f} MiB")
    print(f"cache slots budget {eng.cache_budget_bytes / 2**20:6.0f} MiB")
    print(f"Inductor imported: {'torch._inductor' in sys.modules}")
    if cuda:
        import torch

        free, total = torch.cuda.mem_get_info()
        print(f"cuda peak allocated {torch.cuda.max_memory_allocated() >> 20:6d} MiB{budget}")
        print(f"cuda peak reserved  {torch.cuda.max_memory_reserved() >> 20:6d} MiB")
        print(f"cuda in use at end  {(total - free) >> 20:6d} MiB (context included)")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
