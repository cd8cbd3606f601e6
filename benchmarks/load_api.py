"""Load test of ``bevy serve``: many streaming clients against a server this script starts.

    python benchmarks/load_api.py                      # the demo MoE, 32 clients x 3 requests
    python benchmarks/load_api.py --model DIR --max-tokens 16 --clients 8
    python benchmarks/load_api.py --url http://127.0.0.1:8080   # a server already running

Each client sends its requests one after another (streaming chat completions from a bundled
workload), so up to ``--clients`` requests are in flight. Prints completion tokens/s over the
whole run, requests/s, and p50/p95 of latency and time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.bench.workloads import load_workload  # noqa: E402


@dataclass
class Result:
    latency_s: float
    ttft_s: float  # time to the first generated text
    completion_tokens: int
    error: str = ""


async def one_request(
    http: httpx.AsyncClient, url: str, messages: list[dict], args: argparse.Namespace
) -> Result:
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": not args.allow_eos,
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Result(time.perf_counter() - t0, 0.0, 0, f"{r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(time.perf_counter() - t0, 0.0, 0, chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return Result(latency, latency if ttft is None else ttft, tokens)


async def run_load(
    url: str, args: argparse.Namespace, key: str | None
) -> tuple[list[Result], float]:
    prompts = [r["messages"] for r in load_workload(args.workload)]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:

        async def client(c: int) -> list[Result]:
            return [
                await one_request(http, url, prompts[(c * args.requests + i) % len(prompts)], args)
                for i in range(args.requests)
            ]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client(c) for c in range(args.clients)))
        return [r for rs in per_client for r in rs], time.perf_counter() - t0


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "backend.serving.cli", "serve", "--port", str(port)]
    cmd += ["--cache", args.cache, "--max-queue", str(max(64, args.clients))]
    if args.model:
        cmd += ["--model", str(args.model)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the server did not start in time")
        time.sleep(0.25)


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def report(results: list[Result], wall_s: float, stats: dict | None) -> None:
    ok = [r for r in results if not r.error]
    errors = [r.error for r in results if r.error]
    tokens = sum(r.completion_tokens for r in ok)
    print(f"requests        {len(ok)} ok, {len(errors)} failed in {wall_s:.2f} s")
    if errors:
        print(f"first error     {errors[0]}")
    if not ok:
        return
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok]
    print(f"throughput      {tokens / wall_s:.1f} completion tokens/s ({tokens} tokens)")
    print(f"requests/s      {len(ok) / wall_s:.2f}")
    print(f"latency         p50 {pct(lat, 50):.2f} s   p95 {pct(lat, 95):.2f} s")
    print(f"first token     p50 {pct(ttft, 50):.2f} s   p95 {pct(ttft, 95):.2f} s")
    if stats and "cache_hit_rate" in stats:
        print(f"expert cache    hit rate {stats['cache_hit_rate']:.1%}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the demo MoE")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--api-key", default=None, help="for --url")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=3, help="per client, one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--allow-eos", action="store_true", help="stop at EOS (default: full length)")
    p.add_argument("--workload", default="chat", help="bundled prompt set (chat, agentic)")
    p.add_argument("--cache", default="0.3", help="the started server's expert cache")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args()
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--clients, --requests and --max-tokens must be >= 1")
    proc = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        proc, url = start_server(args)
    try:
        print(
            f"{args.clients} clients x {args.requests} streaming requests, "
            f"{args.max_tokens} tokens each, against {url}",
            flush=True,
        )
        results, wall = asyncio.run(run_load(url, args, args.api_key))
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        stats = httpx.get(f"{url}/v1/stats", headers=headers, timeout=10).json()
        report(results, wall, stats)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
