"""Do running chats keep decoding while a long agent prompt is read? Chats decode on the
demo MoE; an agentic conversation of about ``--prompt-tokens`` tokens (its last turn
carries a file, as a coding agent's tool result would) is submitted beside them.
Reports the chats' inter-token gaps while that prompt is read (p50, p99, max), their
tokens/s then, and the prompt's time to first token, with the prompt read whole
(``prefill_chunk`` 0) and in slices, alternating A B A B on one engine.

    python benchmarks/chunked_prefill.py [--chats 4] [--prompt-tokens 4000]
        [--chunks 0,512] [--rounds 2] [--cache 1.0] [--policy bevy]

The demo MoE is built on first use.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.workloads import load_workload, workload_path  # noqa: E402
from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.loop import chat_prompt  # noqa: E402
from backend.messages import ErrorEvent, Finished, Submit, TokenEvent  # noqa: E402
from backend.serving.service import EngineService  # noqa: E402


def agent_prompt(svc: EngineService, tokens: int) -> list[int]:
    """An agentic conversation whose last turn is a file read, cut to about ``tokens``. The
    file is the bundled agentic workload, which does not change with the code."""
    record = load_workload("agentic")[0]
    source = workload_path("agentic").read_text()
    params = SamplingParams(max_tokens=1)
    lo, hi = 0, len(source)
    while hi - lo > 200:  # bisect the file's length to the prompt size
        mid = (lo + hi) // 2
        msgs = [*record["messages"], {"role": "user", "content": source[:mid]}]
        ids, _ = chat_prompt(svc.model, Submit("size", params, messages=msgs))
        lo, hi = (mid, hi) if len(ids) <= tokens else (lo, mid)
    msgs = [*record["messages"], {"role": "user", "content": source[:lo]}]
    return chat_prompt(svc.model, Submit("size", params, messages=msgs))[0]


def one_round(svc: EngineService, chats: list[list[int]], long: list[int], tag: str) -> dict:
    """Start the chats, let them decode, submit ``long``; gaps until its first token."""
    times: dict[str, list[float]] = {}
    lock = threading.Lock()
    first: dict[str, float] = {}
    done = threading.Event()

    def listen(rid: str):
        def on(ev) -> None:
            if isinstance(ev, TokenEvent):
                with lock:
                    times.setdefault(rid, []).append(time.perf_counter())
                    first.setdefault(rid, time.perf_counter())
            elif isinstance(ev, Finished | ErrorEvent) and rid == "long":
                if isinstance(ev, ErrorEvent):
                    print(f"  {rid}: {ev.message}", file=sys.stderr)
                done.set()

        return on

    run = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    ids = [f"{tag}-chat{i}" for i in range(len(chats))]
    for rid, p in zip(ids, chats, strict=True):
        svc.submit(Submit(rid, run, prompt_ids=p), listen(rid))
    while len(first) < len(chats):  # every chat decoding
        time.sleep(0.05)
    time.sleep(2.0)
    sent = time.perf_counter()
    one = SamplingParams(temperature=0, max_tokens=1)
    svc.submit(Submit("long", one, prompt_ids=long), listen("long"))
    done.wait(timeout=900)
    end = time.perf_counter()
    for rid in ids:
        svc.abort(rid)
    time.sleep(0.5)
    with lock:
        pairs = [p for rid in ids for p in itertools.pairwise(times[rid])]
        gaps = [b - a for a, b in pairs if sent <= b <= end]
        before = [b - a for a, b in pairs if b < sent]
        during = sum(1 for rid in ids for t in times[rid] if sent <= t <= end)
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else float("nan")  # noqa: E731
    return {
        "ttft_s": first.get("long", end) - sent,
        "p50": q(0.5),
        "p99": q(0.99),
        "max": gaps[-1] if gaps else float("nan"),
        "tok_s": during / (end - sent),
        "alone_p50": statistics.median(before) if before else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--chunks", default="0,512", help="prefill_chunk values to alternate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", default="1.0")
    ap.add_argument("--policy", default="bevy")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    config = EngineConfig(cache=args.cache, policy=args.policy)
    svc = EngineService.open(ensure_demo(quiet=False), config)
    try:
        records = load_workload("chat")[: args.chats]
        params = SamplingParams(max_tokens=1)
        chats = [
            chat_prompt(svc.model, Submit("c", params, messages=r["messages"]))[0] for r in records
        ]
        long = agent_prompt(svc, args.prompt_tokens)
        print(
            f"{args.chats} chats ({', '.join(str(len(c)) for c in chats)} prompt tokens), "
            f"a {len(long)}-token agent prompt beside them; {args.policy}, cache {args.cache}"
        )
        print("chunk  round  ttft s  gap p50 ms  gap p99 ms  gap max ms  chats tok/s  alone p50 ms")
        for n in range(args.rounds):
            for chunk in chunks:
                svc.engine.prefill_chunk = chunk  # between rounds, with nothing running
                res = one_round(svc, chats, long, f"{chunk}-{n}")
                print(
                    f"{chunk:>5}  {n + 1:>5}  {res['ttft_s']:6.1f}  {res['p50'] * 1e3:10.0f}"
                    f"  {res['p99'] * 1e3:10.0f}  {res['max'] * 1e3:10.0f}"
                    f"  {res['tok_s']:11.1f}  {res['alone_p50'] * 1e3:12.0f}",
                    flush=True,
                )
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
