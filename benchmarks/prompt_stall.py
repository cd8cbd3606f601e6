"""Does a long chat's prompt stall the requests already running? One request decodes
while a chat just under the context's character bound (many turns, rolling overflow) is
submitted beside it; reports how long fitting that chat takes on its own and the running
request's inter-token gaps alone and beside it.

    python benchmarks/prompt_stall.py [--tokens 120] [--cache 1.0]

Runs on the demo MoE (built on first use). The chat asks for one token, so what the
running request sees is the prompt being made, then its prefill (read in slices, with the
running request's jobs between them: ``prefill_chunk``).
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.loop import chat_prompt  # noqa: E402
from backend.messages import ErrorEvent, Finished, Submit, TokenEvent  # noqa: E402
from backend.serving.service import EngineService  # noqa: E402


def gaps(
    svc: EngineService, tokens: int, beside: list[dict] | None, window_s: float = 0.0
) -> tuple[float, float, float, float]:
    """(median, max) inter-token gap of a running request; the max over the gaps that
    began in the first ``window_s`` after the chat was submitted (while its prompt is
    made); when the chat ended (s after it was submitted; 0 without one)."""
    q: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    svc.submit(Submit("runner", params, prompt_ids=[1, 2, 3]), q.put)
    q.get(timeout=300)
    times = [time.perf_counter()]
    other: queue.Queue = queue.Queue()
    sent = time.perf_counter()
    if beside is not None:
        one = SamplingParams(temperature=0, max_tokens=1)
        svc.submit(Submit("chat", one, messages=beside, overflow="rolling"), other.put)
    while not isinstance(ev := q.get(timeout=600), Finished | ErrorEvent):
        if isinstance(ev, TokenEvent):
            times.append(time.perf_counter())
    answered = 0.0
    if beside is not None:
        while not isinstance(other.get(timeout=600), Finished | ErrorEvent):
            pass
        answered = time.perf_counter() - sent
    pairs = list(zip(times, times[1:], strict=False))
    d = sorted(b - a for a, b in pairs)
    early = [b - a for a, b in pairs if sent <= a <= sent + window_s] or [0.0]
    return d[len(d) // 2], d[-1], max(early), answered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--cache", default="1.0")
    args = ap.parse_args()
    svc = EngineService.open(ensure_demo(quiet=False), EngineConfig(cache=args.cache))
    try:
        tok, ctx = svc.model.tokenizer, svc.model.config.context_length
        bound = (ctx - 1) * tok.max_token_chars
        turn = "the quick brown fox jumps over the lazy dog " * 200
        chat = [{"role": "user", "content": turn}] * int(bound * 0.95 // len(turn))
        chat = [*chat, {"role": "user", "content": "last"}]
        t0 = time.perf_counter()
        ids, dropped = chat_prompt(
            svc.model,
            Submit("fit", SamplingParams(max_tokens=1), messages=chat, overflow="rolling"),
        )
        fit_s = time.perf_counter() - t0
        print(
            f"chat: {sum(len(m['content']) for m in chat):,} chars in {len(chat)} messages; "
            f"fitting it: {fit_s:.2f} s -> {len(ids)} tokens, {dropped} messages left out"
        )
        med, worst, _, _ = gaps(svc, args.tokens, None)
        print(f"running request alone:  gaps median {med * 1e3:.0f} ms, max {worst * 1e3:.0f} ms")
        med, worst, early, answered = gaps(svc, args.tokens, chat, fit_s)
        print(
            f"beside the chat:        gaps median {med * 1e3:.0f} ms, max {worst * 1e3:.0f} ms;"
            f" max while its prompt was made {early * 1e3:.0f} ms;"
            f" the chat ended after {answered:.1f} s"
        )
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
