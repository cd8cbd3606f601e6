"""What `bevy serve` keeps resident once a long prompt has been answered.

    python benchmarks/idle_memory.py [--lines 260] [--wait 2] [-- SERVE ARGS, e.g. --cache 0.3]

Starts `bevy serve` from this tree (the demo MoE unless SERVE ARGS name a model), sends
one chat request whose prompt is ``--lines`` numbered lines of text (260: about 4,900
tokens), and prints the server's resident set (``VmRSS``) before it, right after the
answer, and ``--wait`` seconds later, once the serving loop has gone idle. What a
finished request freed and the process still holds shows as the last figure's excess.
With ``--cache auto`` (the default) the warm-up's reads raise the resident set too: a
fixed ``--cache`` keeps them out of the comparison.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from vs_llamacpp import ROOT, Server, free_port, wait_ready


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=260)
    ap.add_argument("--wait", type=float, default=2.0)
    ap.add_argument("serve_args", nargs="*", help="passed to `bevy serve` (after --)")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "backend.serving.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen([*cmd, *args.serve_args], cwd=ROOT, stdout=subprocess.DEVNULL)
    server = wait_ready(Server("bevy", proc, f"http://127.0.0.1:{port}"))
    try:
        from openai import OpenAI

        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        text = " ".join(
            f"Line {i}: the quick brown fox jumps over the lazy dog and then rests."
            for i in range(args.lines)
        )
        time.sleep(args.wait)
        print(f"before: {rss_mib(proc.pid)} MiB")
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text + "\nSummarize."}],
            max_tokens=8,
            temperature=0,
        )
        took = time.perf_counter() - t0
        print(
            f"right after: {rss_mib(proc.pid)} MiB"
            f" ({reply.usage.prompt_tokens} prompt tokens, {took:.1f} s)"
        )
        time.sleep(args.wait)
        print(f"{args.wait:g} s later: {rss_mib(proc.pid)} MiB")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
