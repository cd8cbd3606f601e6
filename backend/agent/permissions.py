"""Which tool calls run at once, which ask the user, and which are refused.

A rule is (tool, glob pattern, action) with action "allow", "ask" or "deny". The pattern
is matched against the call's subject: the command line for ``run_command``, the path
for file tools. A deny rule that matches wins over everything; then the most specific
matching rule (the longest pattern) decides; then the tool's default: reading runs,
changing asks. "Always allow" adds a session rule (``Rules.always``).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field

ACTIONS = ("allow", "ask", "deny")
# What a tool does when no rule speaks of it: reading runs, changing or running asks.
DEFAULTS = {
    "list_dir": "allow",
    "read_file": "allow",
    "search": "allow",
    "finish": "allow",
    "write_file": "ask",
    "edit_file": "ask",
    "run_command": "ask",
}


# Shell syntax that chains, pipes, redirects or substitutes commands.
_CONTROL = re.compile(r"[;&|<>`\n]|\$\(")
_SPLIT = re.compile(r"&&|\|\||[;&|\n(){}`]|\$\(")
# Words before the command itself that a rule must look through ("then rm", "VAR=1 rm").
_LEAD = re.compile(
    r"^(?:(?:then|do|else|elif|if|while|until|!|time|exec|command|builtin|nohup|env|sudo)\s+"
    r"|[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+"
)
# Programs that run whatever their arguments say: "always" allows only the exact line.
_RUNNERS = {
    "bash",
    "sh",
    "zsh",
    "dash",
    "env",
    "sudo",
    "xargs",
    "find",
    "python",
    "python3",
    "perl",
    "ruby",
    "node",
    "npx",
    "eval",
    "exec",
    "nohup",
    "timeout",
    "watch",
}


def _words(command: str) -> str:
    """A command with its whitespace collapsed and leading keywords and assignments off."""
    return _LEAD.sub("", " ".join(command.split()))


@dataclass(frozen=True)
class Rule:
    tool: str  # a tool name, or "*" for every tool
    pattern: str = "*"
    action: str = "allow"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"a rule's action must be one of {', '.join(ACTIONS)}")

    def matches(self, tool: str, subject: str) -> bool:
        if self.tool not in ("*", tool):
            return False
        # "pytest *" also covers a bare "pytest".
        bare = self.pattern.endswith(" *") and subject == self.pattern[:-2]
        return bare or fnmatch.fnmatchcase(subject, self.pattern)

    @classmethod
    def parse(cls, text: str) -> Rule:
        """ "action tool pattern", e.g. ``allow run_command pytest *``."""
        parts = text.strip().split(None, 2)
        if len(parts) < 2:
            raise ValueError(f"a rule is 'action tool [pattern]', not {text!r}")
        action, tool = parts[0], parts[1]
        return cls(tool, parts[2] if len(parts) > 2 else "*", action)

    def __str__(self) -> str:
        return f"{self.action} {self.tool} {self.pattern}"


def _specificity(rule: Rule) -> tuple[int, bool]:
    return len(rule.pattern) - rule.pattern.count("*"), rule.tool != "*"


def subject(tool: str, args: dict) -> str:
    """What a call's rules are matched against."""
    if tool == "run_command":
        return str(args.get("command", "")).strip()
    return str(args.get("path", "."))


@dataclass
class Rules:
    rules: list[Rule] = field(default_factory=list)

    def decide(self, tool: str, args: dict) -> str:
        """ "allow", "ask" or "deny" for this call."""
        what = subject(tool, args)
        parts = [what]
        if tool == "run_command":
            # Best effort, not a shell parser: deny and ask rules hold for every command a
            # line chains, groups or substitutes (keywords and assignments before it
            # looked through); an allow rule only for a line that is one plain command
            # ("pytest *" must not let "pytest; rm -rf ~" through).
            what = _words(what)
            parts = [what, *(_words(p) for p in _SPLIT.split(what) if p.strip())]
        for action in ("deny", "ask"):
            for r in self.rules:
                if r.action == action and any(r.matches(tool, p) for p in parts):
                    if action == "deny":
                        return "deny"
                    if self._more_specific_allow(tool, what, r) is None:
                        return "ask"
        matching = [r for r in self.rules if r.matches(tool, what) and r.action != "deny"]
        if tool == "run_command" and _CONTROL.search(what):
            matching = [r for r in matching if r.action != "allow" or r.pattern == "*"]
        if matching:
            return max(matching, key=_specificity).action
        return DEFAULTS.get(tool, "ask")

    def _more_specific_allow(self, tool: str, what: str, ask: Rule) -> Rule | None:
        """An allow rule for the whole line more specific than ``ask`` (it then wins)."""
        if tool == "run_command" and _CONTROL.search(what):
            return None
        allows = [r for r in self.rules if r.action == "allow" and r.matches(tool, what)]
        best = max(allows, key=_specificity, default=None)
        return best if best is not None and _specificity(best) > _specificity(ask) else None

    def always(self, tool: str, args: dict) -> Rule:
        """Allow calls like this one for the rest of the session; returns the new rule:
        the same program for a command (``pytest *``; ``git status *``; the exact line for
        shells, interpreters and programs that run others), any file for a file tool."""
        if tool == "run_command":
            try:
                words = shlex.split(subject(tool, args))
            except ValueError:
                words = subject(tool, args).split()
            if not words or words[0] in _RUNNERS or _CONTROL.search(subject(tool, args)):
                pattern = _words(subject(tool, args))  # this exact line only
            elif words[0] == "git" and len(words) > 1:
                pattern = f"git {words[1]} *"  # one subcommand: "git status *", not git
            else:
                pattern = f"{words[0]} *"
        else:
            pattern = "*"
        rule = Rule(tool, pattern, "allow")
        self.rules.append(rule)
        return rule
