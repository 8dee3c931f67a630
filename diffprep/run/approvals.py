"""The questions a run asks before it changes existing data, and the terminal way of asking them.

A question states what exists, what would be lost and the choices (Markdown,
rendered in the Prefect UI's resume form). It can be answered ahead of time by
a parameter (``on_existing``, ``accept_rejects``, ``on_split_change``): that
explicit value is the approval for that exact action. Asking in the Prefect UI
lives in ``tasks/approvals.py``; this module has no Prefect import.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol, TextIO

from diffprep.errors import DiffprepError

ABORT = "abort"


class ApprovalRefused(DiffprepError):
    """A question was answered abort, refused, or not answered in time: nothing was changed."""


@dataclass(frozen=True)
class Question:
    key: str  # stable id: lowercase letters, digits, dashes (a Prefect pause key)
    title: str
    description: str  # Markdown: what exists, what would be lost, what each choice does
    choices: tuple[str, ...]  # the safe choice (abort) is always one of them
    preset_hint: str  # how to answer ahead of time, e.g. "--on-existing new-dir|overwrite"

    def __post_init__(self) -> None:
        if ABORT not in self.choices:
            raise ValueError(f"question {self.key!r} must offer {ABORT!r}, got {self.choices}")

    def refused(self, why: str) -> ApprovalRefused:
        return ApprovalRefused(
            f"{self.title}: {why}; nothing was changed.\n\n{self.description}\n\n"
            f"To decide ahead of time, re-run with {self.preset_hint}."
        )

    def check(self, answer: str) -> str:
        """The answer when it is one of the choices; abort ends the run (nothing changed)."""
        if answer not in self.choices:
            raise ApprovalRefused(f"{self.title}: {answer!r} is not one of {', '.join(self.choices)}")
        if answer == ABORT:
            raise self.refused("aborted")
        return answer


def ask_terminal(question: Question, stdin: TextIO | None = None, stdout: TextIO | None = None) -> str | None:
    """Ask on the terminal; None when there is no terminal to ask on."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if not (stdin and stdin.isatty()):
        return None
    print(f"\n{question.title}\n\n{question.description}\n", file=stdout)
    prompt = f"Choose {' / '.join(question.choices)} [{ABORT}]: "
    while True:
        print(prompt, end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:  # end of input: the safe choice
            return ABORT
        answer = line.strip() or ABORT
        if answer in question.choices:
            return answer
        print(f"  '{answer}' is not one of {', '.join(question.choices)}", file=stdout)


class Ask(Protocol):
    """How a run asks its questions: ``preset`` is an answer given ahead (a flag); ``release=True`` marks a question
    asked after work was done (a flow run on a deployment may give its infrastructure back while it waits)."""

    def __call__(self, question: Question, preset: str | None = None, *, release: bool = False) -> str: ...


def ask_here(question: Question, preset: str | None = None, *, release: bool = False) -> str:
    """The answer from ``preset``, else from the terminal; with neither, the safe choice (abort) is taken."""
    if preset is not None:
        return question.check(preset)
    answer = ask_terminal(question)
    if answer is None:
        raise question.refused(f"no terminal and no Prefect server to ask on: took the safe choice ({ABORT})")
    return question.check(answer)
