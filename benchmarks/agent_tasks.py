"""Small coding tasks for the agent loop, each with a checker: how many a model solves.

    .venv/bin/python benchmarks/agent_tasks.py [--model PATH] [--tasks hello,fix-test]
        [--max-steps 15] [--json out.json]

Each task starts from fresh files in a temp workspace; the agent runs with every call
approved (as ``bevy agent --yes``; commands sandboxed when bubblewrap is installed), and
the checker then looks at the workspace itself, not at what the model said. One engine
serves every task. The report gives, per task, whether it passed, the steps, calls and
seconds it took, and how the loop ended.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.agent.loop import Agent, CallFinished, StepStarted  # noqa: E402
from backend.agent.workspace import Workspace  # noqa: E402


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    files: dict[str, str]
    check: Callable[[Path], bool]


def _run(ws: Path, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ws, capture_output=True, text=True, timeout=60)


def _read(ws: Path, name: str) -> str:
    p = ws / name
    return p.read_text() if p.is_file() else ""


TASKS = [
    Task(
        "hello",
        "Create the file hello.txt containing the word hi.",
        {},
        lambda ws: _read(ws, "hello.txt").strip() == "hi",
    ),
    Task(
        "fix-test",
        "The test in test_calc.py fails. Fix the bug in calc.py so that it passes "
        "(run it with: python3 -m pytest -q).",
        {
            "calc.py": "def add(a, b):\n    return a - b\n",
            "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
        },
        lambda ws: (
            _run(ws, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider").returncode == 0
            and "return a - b" not in _read(ws, "calc.py")
        ),
    ),
    Task(
        "fizzbuzz",
        "Write fizzbuzz.py that prints the numbers 1 to 15, one per line, with Fizz for "
        "multiples of 3, Buzz for multiples of 5 and FizzBuzz for both. Run it to check.",
        {},
        lambda ws: (
            (ws / "fizzbuzz.py").is_file()
            and _run(ws, sys.executable, "fizzbuzz.py").stdout.split()
            == [
                "FizzBuzz"
                if i % 15 == 0
                else "Fizz"
                if i % 3 == 0
                else "Buzz"
                if i % 5 == 0
                else str(i)
                for i in range(1, 16)
            ]
        ),
    ),
    Task(
        "rename",
        "Rename the function greet in util.py to welcome, and update main.py, which calls it.",
        {
            "util.py": "def greet(name):\n    return f'hello {name}'\n",
            "main.py": "from util import greet\n\nprint(greet('bevy'))\n",
        },
        lambda ws: (
            "def welcome" in _read(ws, "util.py")
            and "greet" not in _read(ws, "util.py") + _read(ws, "main.py")
            and _run(ws, sys.executable, "main.py").stdout.strip() == "hello bevy"
        ),
    ),
]


def run_task(model, task: Task, max_steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bevy-agent-{task.name}-") as tmp:
        ws = Path(tmp)
        for name, text in task.files.items():
            (ws / name).write_text(text)
        steps = calls = 0

        def on_event(ev) -> None:
            nonlocal steps, calls
            if isinstance(ev, StepStarted):
                steps += 1
            elif isinstance(ev, CallFinished):
                calls += 1

        agent = Agent(
            model,
            Workspace(ws),
            approve=lambda c: "approve",
            on_event=on_event,
            max_steps=max_steps,
        )
        t0 = time.monotonic()
        end = agent.run(task.prompt)
        seconds = time.monotonic() - t0
        passed = task.check(ws)
    return {
        "task": task.name,
        "passed": passed,
        "steps": steps,
        "calls": calls,
        "seconds": round(seconds, 1),
        "ended": end.reason,
        "message": end.message[:200],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="GGUF file or HF folder (default: the demo MoE)"
    )
    p.add_argument("--tasks", default=",".join(t.name for t in TASKS))
    p.add_argument("--max-steps", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--cache", default="1.0", help="expert cache (default: every expert)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from backend.config import EngineConfig
    from backend.demo.build import ensure_demo
    from backend.serving.chat_model import LocalChatModel
    from backend.serving.service import EngineService

    chosen = {t.strip() for t in args.tasks.split(",") if t.strip()}
    tasks = [t for t in TASKS if t.name in chosen]
    if not tasks:
        p.error(f"no such tasks; the tasks are {', '.join(t.name for t in TASKS)}")
    service = EngineService.open(args.model or ensure_demo(), EngineConfig(cache=args.cache))
    try:
        model = LocalChatModel(
            service, "agent-bench", {"temperature": 0.0, "max_tokens": args.max_tokens}
        )
        rows = []
        for task in tasks:
            row = run_task(model, task, args.max_steps)
            rows.append(row)
            print(
                f"{row['task']:<10} {'PASS' if row['passed'] else 'fail'}  steps {row['steps']:>2}  "
                f"calls {row['calls']:>2}  {row['seconds']:>6.1f} s  ended: {row['ended']} ({row['message']})",
                flush=True,
            )
    finally:
        service.close()
    solved = sum(r["passed"] for r in rows)
    print(
        f"\n{solved} of {len(rows)} tasks solved by {service.model_name} (tool format {model.tool_format})"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"model": service.model_name, "tasks": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
