"""``ask()``: the one function that asks every approval question.

In a flow run talking to a Prefect server (``PREFECT_API_URL`` set), the run
pauses with ``pause_flow_run(wait_for_input=...)``: the UI shows the question's
Markdown and a dropdown of the choices. In a terminal without a server it asks
on the terminal. With neither, it takes the safe choice (abort). An answer
given ahead of time (a parameter) is the approval for that exact action and
nothing is asked. Abort, a refusal or a timeout raises ``ApprovalRefused``:
nothing was changed and the run ends not completed.

Call it from the flow, not from inside a task: only a flow run can pause.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, create_model

from diffprep.approvals import ABORT, ApprovalRefused, Question, ask_terminal

log = logging.getLogger("diffprep.approvals")

POLL_SECONDS = 2


def _server_run() -> bool:
    """True inside a flow run whose API is a Prefect server someone can open (not the embedded one)."""
    from prefect.context import FlowRunContext
    from prefect.settings import get_current_settings

    return FlowRunContext.get() is not None and bool(get_current_settings().api.url)


def _input_model(question: Question):
    from prefect.input import RunInput

    choice_type = Literal[question.choices]  # type: ignore[valid-type]
    return create_model(
        "Approval",
        __base__=RunInput,
        answer=(choice_type, Field(description=" | ".join(question.choices))),
    )


def ask(question: Question, preset: str | None = None, *, timeout: int = 3600) -> str:
    """The answer to ``question`` (never ``abort``: that raises ApprovalRefused)."""
    if preset is not None:
        return question.check(preset)
    if _server_run():
        from prefect.exceptions import FlowPauseTimeout
        from prefect.flow_runs import pause_flow_run

        log.warning("%s: waiting up to %d s for an answer in the Prefect UI (Resume on the paused run)",
                    question.title, timeout)
        model = _input_model(question).with_initial_data(description=question.description)
        try:
            answer = pause_flow_run(wait_for_input=model, timeout=timeout, poll_interval=POLL_SECONDS,
                                    key=question.key)
        except FlowPauseTimeout:
            raise question.refused(f"no answer within {timeout} s") from None
        return question.check(answer.answer)
    answer = ask_terminal(question)
    if answer is None:
        raise question.refused(f"no terminal and no Prefect server to ask on: took the safe choice ({ABORT})")
    return question.check(answer)


__all__ = ["ApprovalRefused", "ask"]
