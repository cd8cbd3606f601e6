"""Permission rules: defaults, deny first, the most specific rule, chained commands."""

from __future__ import annotations

import pytest

from backend.agent.permissions import Rule, Rules


def cmd(line: str) -> dict:
    return {"command": line}


def test_reading_runs_and_changing_asks_by_default() -> None:
    rules = Rules()
    assert rules.decide("read_file", {"path": "a.py"}) == "allow"
    assert rules.decide("search", {"pattern": "x"}) == "allow"
    assert rules.decide("write_file", {"path": "a.py", "content": ""}) == "ask"
    assert rules.decide("run_command", cmd("ls")) == "ask"


def test_deny_wins_and_the_most_specific_rule_decides() -> None:
    rules = Rules(
        [
            Rule.parse("allow run_command pytest *"),
            Rule.parse("deny run_command rm -rf *"),
            Rule.parse("allow write_file *"),
            Rule.parse("ask write_file secrets/*"),
            Rule.parse("deny * .env"),
        ]
    )
    assert rules.decide("run_command", cmd("pytest -q tests")) == "allow"
    assert rules.decide("run_command", cmd("pytest")) == "allow"  # "pytest *" covers it
    assert rules.decide("run_command", cmd("rm -rf build")) == "deny"
    assert rules.decide("write_file", {"path": "src/a.py"}) == "allow"
    assert rules.decide("write_file", {"path": "secrets/key"}) == "ask"
    assert rules.decide("read_file", {"path": ".env"}) == "deny"


@pytest.mark.parametrize(
    "line, expected",
    [
        ("pytest; rm -rf ~", "deny"),  # the denied part is found in the chain
        ("pytest && curl x | sh", "ask"),  # allowed prefix, but not one plain command
        ("pytest $(rm -rf /)", "deny"),
        ("pytest > out.txt", "ask"),
        ("echo `rm -rf x`", "deny"),
    ],
)
def test_an_allow_rule_never_covers_a_chained_command(line: str, expected: str) -> None:
    rules = Rules([Rule.parse("allow run_command pytest *"), Rule.parse("deny run_command rm *")])
    assert rules.decide("run_command", cmd(line)) == expected


def test_always_allows_the_same_program_for_the_session() -> None:
    rules = Rules()
    assert str(rules.always("run_command", cmd("pytest -q tests"))) == "allow run_command pytest *"
    assert rules.decide("run_command", cmd("pytest -x")) == "allow"
    assert rules.decide("run_command", cmd("bash x.sh")) == "ask"
    # Programs that run whatever they are told get the exact line, git one subcommand.
    assert str(rules.always("run_command", cmd("python -m pytest"))) == (
        "allow run_command python -m pytest"
    )
    assert rules.decide("run_command", cmd("python -c 'import os'")) == "ask"
    assert str(rules.always("run_command", cmd("git status"))) == "allow run_command git status *"
    assert rules.decide("run_command", cmd("git push")) == "ask"
    rules.always("edit_file", {"path": "a.py"})
    assert rules.decide("edit_file", {"path": "b/c.py"}) == "allow"


@pytest.mark.parametrize(
    "line, expected",
    [
        ("true && git push origin", "ask"),  # the ask rule holds for a chained part
        ("git  push", "ask"),  # whitespace does not hide it
        ("if :; then rm -rf x; fi", "deny"),  # nor shell keywords
        ("FOO=1 rm -rf x", "deny"),  # nor assignments
        ("{ rm -rf x; }", "deny"),
        ("git status", "allow"),
    ],
)
def test_rules_look_through_shell_spelling(line: str, expected: str) -> None:
    rules = Rules(
        [
            Rule.parse("allow run_command *"),
            Rule.parse("ask run_command git push*"),
            Rule.parse("deny run_command rm *"),
        ]
    )
    assert rules.decide("run_command", cmd(line)) == expected


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError):
        Rule.parse("maybe run_command ls")
    with pytest.raises(ValueError):
        Rule.parse("allow")
