"""``ask()`` outside a flow run: answers given ahead of time, the terminal, and no terminal at all.

The paused-run path (a question answered in the Prefect UI) is in test_flow.py, against a real server.
"""

from __future__ import annotations

import io
import sys

# Prefect's console log handler keeps the stream it finds when prefect is first imported; ask() imports
# it on first use. Import it here, at collection, so it holds pytest's session stream, not a test's.
import prefect.context  # noqa: F401
import pytest

from diffprep.run.approvals import ABORT, ApprovalRefused, Question
from diffprep.tasks.approvals import ask


class FakeTerminal(io.StringIO):
    """A stdin that says it is a terminal and holds the lines a person would type."""

    def isatty(self) -> bool:
        return True


class NotATerminal(io.StringIO):
    """A stdin with an answer waiting that is not a terminal (a pipe, a CI log): it must not be read."""

    def isatty(self) -> bool:
        return False


def question() -> Question:
    return Question(
        key="existing-output",
        title="The output /data/out already holds data this run would change",
        description="- 3 finished shard(s)\n- 1 file(s) diffprep did not write: `notes.txt`",
        choices=("new-dir", "overwrite", "reuse", ABORT),
        preset_hint="--on-existing new-dir|overwrite|reuse|abort",
    )


def answer_on_terminal(monkeypatch: pytest.MonkeyPatch, typed: str) -> FakeTerminal:
    terminal = FakeTerminal(typed)
    monkeypatch.setattr(sys, "stdin", terminal)
    return terminal


# Answers given ahead of time (a parameter): nothing is asked


def test_a_preset_choice_is_the_answer_and_nothing_is_asked(monkeypatch, capsys) -> None:
    terminal = answer_on_terminal(monkeypatch, "reuse\n")
    assert ask(question(), preset="overwrite") == "overwrite"
    assert terminal.tell() == 0  # the terminal was not read
    assert capsys.readouterr().out == ""


def test_a_preset_abort_refuses_and_says_how_to_decide_ahead(monkeypatch) -> None:
    answer_on_terminal(monkeypatch, "overwrite\n")
    with pytest.raises(ApprovalRefused) as refused:
        ask(question(), preset="abort")
    message = str(refused.value)
    assert "aborted" in message and "nothing was changed" in message
    assert "notes.txt" in message  # what exists, so the user knows what they refused to change
    assert "re-run with --on-existing new-dir|overwrite|reuse|abort" in message


def test_a_preset_that_is_not_a_choice_is_refused(monkeypatch) -> None:
    answer_on_terminal(monkeypatch, "overwrite\n")
    with pytest.raises(ApprovalRefused, match=r"'delete' is not one of new-dir, overwrite, reuse, abort"):
        ask(question(), preset="delete")


# No Prefect server: the terminal, or the safe choice


def test_without_a_terminal_the_safe_choice_is_taken(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", NotATerminal("overwrite\n"))
    with pytest.raises(ApprovalRefused) as refused:
        ask(question())
    message = str(refused.value)
    assert "no terminal and no Prefect server" in message and "safe choice (abort)" in message
    assert "nothing was changed" in message and "--on-existing" in message
    assert sys.stdin.tell() == 0


def test_an_answer_typed_on_the_terminal_is_taken(monkeypatch, capsys) -> None:
    answer_on_terminal(monkeypatch, "overwrite\n")
    assert ask(question()) == "overwrite"
    shown = capsys.readouterr().out
    assert "already holds data" in shown and "notes.txt" in shown  # the question and what exists
    assert "Choose new-dir / overwrite / reuse / abort [abort]: " in shown


def test_a_wrong_answer_on_the_terminal_is_asked_again(monkeypatch, capsys) -> None:
    answer_on_terminal(monkeypatch, "yes please\n  new-dir  \n")
    assert ask(question()) == "new-dir"
    shown = capsys.readouterr().out
    assert "'yes please' is not one of new-dir, overwrite, reuse, abort" in shown
    assert shown.count("Choose ") == 2


@pytest.mark.parametrize("typed", ["\n", "", "abort\n"], ids=["empty-line", "end-of-input", "abort"])
def test_enter_end_of_input_or_abort_on_the_terminal_refuse(monkeypatch, typed: str) -> None:
    answer_on_terminal(monkeypatch, typed)
    with pytest.raises(ApprovalRefused, match="aborted; nothing was changed"):
        ask(question())


def test_a_question_must_offer_abort() -> None:
    with pytest.raises(ValueError, match="must offer 'abort'"):
        Question(key="replace-split", title="t", description="d", choices=("replace", "keep"), preset_hint="h")


# What a question says


def test_the_existing_output_question_names_every_file_and_what_overwrite_cannot_keep(tmp_path, make_plan) -> None:
    from diffprep.phases.existing import inspect_output

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "000000.tar").write_bytes(b"not ours")
    inspection = inspect_output(out, make_plan())
    assert inspection.needs_choice
    description = inspection.question().description
    assert "`notes.txt`" in description
    # 000000.tar is not diffprep's (no manifest or plan names it) and this run writes a shard of that name:
    # overwrite cannot keep it, so it is not offered, and the question says why.
    assert inspection.blocking == ["000000.tar"]
    assert "overwrite" not in inspection.question().choices
    assert "`000000.tar`" in description and "cannot keep them" in description
