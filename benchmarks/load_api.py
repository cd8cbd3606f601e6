"""Load test of ``bevy serve``: many streaming clients against a server this script starts.

    python benchmarks/load_api.py                      # the demo MoE, 32 clients x 3 requests
    python benchmarks/load_api.py --model DIR --max-tokens 16 --clients 8
    python benchmarks/load_api.py --url http://127.0.0.1:8080   # a server already running
    python benchmarks/load_api.py --dialects openai,ollama,anthropic   # clients of all three
    python benchmarks/load_api.py --clients 8 --requests 2 --rounds 5   # memory, round by round

Each client sends its requests one after another (streaming chats from a bundled
workload), so up to ``--clients`` requests are in flight. With ``--dialects`` the clients
take the listed APIs in turn (OpenAI's chat completions, Ollama's /api/chat, Anthropic's
/v1/messages), each read in its own wire format. Prints completion tokens/s over the
whole run, requests/s, and p50/p95 of latency and time to first token (per dialect too).
With ``--rounds N`` the same load runs N times against one server, and after each round
the server's memory is printed (of a server this script started: its peak resident set,
and what is resident now, anonymous and file-backed): a server that keeps what its
requests left behind grows round by round.
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
    dialect: str = "openai"


def _request_body(dialect: str, messages: list[dict], args: argparse.Namespace) -> tuple[str, dict]:
    """The path and body of one streaming chat in ``dialect``."""
    if dialect == "ollama":
        options = {
            "temperature": args.temperature,
            "num_predict": args.max_tokens,
            "ignore_eos": not args.allow_eos,
        }
        return "/api/chat", {"model": "default", "messages": messages, "options": options}
    if dialect == "anthropic":
        system = [m["content"] for m in messages if m["role"] == "system"]
        body = {
            "model": "default",
            "max_tokens": args.max_tokens,
            "messages": [m for m in messages if m["role"] != "system"],
            "stream": True,
            "temperature": args.temperature,
            "ignore_eos": not args.allow_eos,
        }
        if system:
            body["system"] = "\n\n".join(system)
        return "/v1/messages", body
    return "/v1/chat/completions", {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": not args.allow_eos,
    }


def _read_line(dialect: str, line: str) -> tuple[str | None, bool, int | None]:
    """(an error, whether the line carries reply text, the completion token count) of
    one line of a stream in ``dialect``."""
    if dialect == "ollama":
        if not line:
            return None, False, None
        chunk = json.loads(line)
        if "error" in chunk:
            return chunk["error"], False, None
        count = chunk.get("eval_count") if chunk.get("done") else None
        return None, bool(chunk.get("message", {}).get("content")), count
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None, False, None
    chunk = json.loads(line[6:])
    if dialect == "anthropic":
        kind = chunk.get("type")
        if kind == "error":
            return chunk["error"]["message"], False, None
        if kind == "message_delta":
            return None, False, chunk["usage"]["output_tokens"]
        delta = chunk.get("delta", {}) if kind == "content_block_delta" else {}
        return None, bool(delta.get("text")), None
    if "error" in chunk:
        return chunk["error"]["message"], False, None
    text = bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
    usage = chunk.get("usage")
    return None, text, usage["completion_tokens"] if usage else None


async def one_request(
    http: httpx.AsyncClient,
    url: str,
    messages: list[dict],
    args: argparse.Namespace,
    dialect: str = "openai",
) -> Result:
    path, body = _request_body(dialect, messages, args)
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            error = f"{r.status_code}: {r.text[:200]}"
            return Result(time.perf_counter() - t0, 0.0, 0, error, dialect)
        async for line in r.aiter_lines():
            error, text, count = _read_line(dialect, line)
            if error:
                return Result(time.perf_counter() - t0, 0.0, 0, error, dialect)
            if ttft is None and text:
                ttft = time.perf_counter() - t0
            if count is not None:
                tokens = count
    latency = time.perf_counter() - t0
    return Result(latency, latency if ttft is None else ttft, tokens, "", dialect)


async def run_load(
    url: str, args: argparse.Namespace, key: str | None
) -> tuple[list[Result], float]:
    prompts = [r["messages"] for r in load_workload(args.workload)]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    dialects = args.dialects.split(",")
    limits = httpx.Limits(max_connections=args.clients + 4)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:

        async def client(c: int) -> list[Result]:
            dialect = dialects[c % len(dialects)]
            return [
                await one_request(
                    http, url, prompts[(c * args.requests + i) % len(prompts)], args, dialect
                )
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
    if len({r.dialect for r in ok}) > 1:
        for dialect in sorted({r.dialect for r in results}):
            mine = [r for r in ok if r.dialect == dialect]
            failed = sum(1 for r in results if r.dialect == dialect and r.error)
            if mine:
                print(
                    f"  {dialect:<13} {len(mine)} ok, {failed} failed; first token p50 "
                    f"{pct([r.ttft_s for r in mine], 50):.2f} s, "
                    f"{sum(r.completion_tokens for r in mine)} tokens"
                )
    if stats and "cache_hit_rate" in stats:
        print(f"expert cache    hit rate {stats['cache_hit_rate']:.1%}")


def memory(proc: subprocess.Popen | None, stats: dict | None) -> None:
    """The server's memory now: from /proc for a server this script started (Linux), else
    what its /v1/stats says."""
    fields = {}
    if proc is not None:
        try:
            text = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in ("VmHWM", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0]) >> 10
    if fields:
        print(
            f"memory          peak {fields.get('VmHWM', 0)} MiB; now {fields.get('RssAnon', 0)}"
            f" MiB anonymous, {fields.get('RssFile', 0)} MiB file-backed"
        )
    elif stats and "memory_mib" in stats:
        print(f"memory          {stats['memory_mib'].get('rss', 0):.0f} MiB resident")


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
    p.add_argument(
        "--dialects",
        default="openai",
        help="APIs the clients speak in turn, from openai, ollama, anthropic",
    )
    p.add_argument("--cache", default="0.3", help="the started server's expert cache")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--rounds", type=int, default=1, help="run the load this many times")
    args = p.parse_args()
    if min(args.clients, args.requests, args.max_tokens, args.rounds) < 1:
        p.error("--clients, --requests, --max-tokens and --rounds must be >= 1")
    unknown = set(args.dialects.split(",")) - {"openai", "ollama", "anthropic"}
    if unknown:
        p.error(f"unknown dialect(s) {', '.join(sorted(unknown))}: use openai, ollama, anthropic")
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
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        for k in range(args.rounds):
            if args.rounds > 1:
                print(f"--- round {k + 1} of {args.rounds}", flush=True)
            results, wall = asyncio.run(run_load(url, args, args.api_key))
            stats = httpx.get(f"{url}/v1/stats", headers=headers, timeout=10).json()
            report(results, wall, stats)
            memory(proc, stats)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
