"""benchmarks/agent_tasks.py: each checker fails on the task's starting files and passes
on a correct solution, so a reported pass means the workspace really holds one."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.agent_tasks import TASKS

SOLUTIONS = {
    "hello": {"hello.txt": "hi\n"},
    "fix-test": {"calc.py": "def add(a, b):\n    return a + b\n"},
    "fizzbuzz": {
        "fizzbuzz.py": "for i in range(1, 16):\n"
        "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else "
        "'Buzz' if i % 5 == 0 else i)\n"
    },
    "rename": {
        "util.py": "def welcome(name):\n    return f'hello {name}'\n",
        "main.py": "from util import welcome\n\nprint(welcome('bevy'))\n",
    },
}


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_a_checker_tells_a_solution_from_the_start(task, tmp_path: Path) -> None:
    for name, text in task.files.items():
        (tmp_path / name).write_text(text)
    assert not task.check(tmp_path)
    for name, text in SOLUTIONS[task.name].items():
        (tmp_path / name).write_text(text)
    assert task.check(tmp_path)
