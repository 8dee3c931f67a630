"""``ask()``: the one function that asks every approval question.

In a flow run talking to a Prefect server (``PREFECT_API_URL`` set), the run
waits for an answer in the UI, which shows the question's Markdown and a
dropdown of the choices. In a terminal without a server it asks on the
terminal. With neither, it takes the safe choice (abort). An answer given ahead
of time (a parameter) is the approval for that exact action and nothing is
asked. Abort, a refusal or a timeout ends the run: nothing was changed.

How a server run waits:

- ``release=False`` (questions before anything is written): the run pauses in
  its process (``pause_flow_run``), which keeps polling for the answer.
- ``release=True`` (questions after encoding, whose work is committed and is
  not redone) in a deployment run: the run is suspended (``suspend_flow_run``):
  its process exits, releasing the machine and its GPUs. The answer reschedules
  the run; a worker runs the flow again from the top, which must find its work
  done (the unit manifests) and come back to the same ``ask``: the question's
  key finds the stored answer, and the run goes on without suspending again.
  Runs without a deployment (``diffprep encode`` in a terminal, a flow called
  from Python) and subflows pause instead: the server refuses to suspend them.

Call it from the flow, not from inside a task: only a flow run can pause.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, create_model

from diffprep.run.approvals import ABORT, ApprovalRefused, Question, ask_terminal

log = logging.getLogger("diffprep.approvals")

POLL_SECONDS = 2
# Flow-run labels naming the question a run waits on: the "waiting for an answer" automation
# (flows/automations.py) reads them, since a Paused/Suspended state's event carries no question.
QUESTION_LABEL = "diffprep.question"
QUESTION_KEY_LABEL = "diffprep.question-key"


def _server_run() -> bool:
    """True inside a flow run whose API is a Prefect server someone can open (not the embedded one)."""
    from prefect.context import FlowRunContext
    from prefect.settings import get_current_settings

    return FlowRunContext.get() is not None and bool(get_current_settings().api.url)


def _suspendable_run() -> bool:
    """True inside a deployment's top-level flow run: the only runs the server lets suspend and reschedule."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    return run is not None and run.deployment_id is not None and run.parent_task_run_id is None


def _label_run(question: Question) -> None:
    """Name the question on the flow run (labels), for the notification sent when it pauses."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(FlowRunContext.get().flow_run.id,
                                      {QUESTION_LABEL: question.title, QUESTION_KEY_LABEL: question.key})


def _input_model(question: Question):
    from prefect.input import RunInput

    choice_type = Literal[question.choices]  # type: ignore[valid-type]
    return create_model(
        "Approval",
        __base__=RunInput,
        answer=(choice_type, Field(description=" | ".join(question.choices))),
    )


def ask(question: Question, preset: str | None = None, *, timeout: int = 3600, release: bool = False) -> str:
    """The answer to ``question`` (never ``abort``: that raises ApprovalRefused).

    ``release=True``: the caller's work so far is committed and a re-run from
    the top redoes none of it, so a deployment run may give up its process
    while it waits (see the module docstring). The first call then does not
    return: the run's process exits with the run Suspended.
    """
    if preset is not None:
        return question.check(preset)
    if _server_run():
        model = _input_model(question).with_initial_data(description=question.description)
        _label_run(question)
        if release and _suspendable_run():
            return question.check(_suspend(question, model, timeout))
        return question.check(_pause(question, model, timeout))
    answer = ask_terminal(question)
    if answer is None:
        raise question.refused(f"no terminal and no Prefect server to ask on: took the safe choice ({ABORT})")
    return question.check(answer)


def _pause(question: Question, model, timeout: int) -> str:
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

    log.warning("%s: waiting up to %d s for an answer in the Prefect UI (Resume on the paused run)",
                question.title, timeout)
    try:
        answer = pause_flow_run(wait_for_input=model, timeout=timeout, poll_interval=POLL_SECONDS, key=question.key)
    except FlowPauseTimeout:
        raise question.refused(f"no answer within {timeout} s") from None
    return answer.answer


def _suspend(question: Question, model, timeout: int) -> str:
    """The stored answer when the run was resumed with one; else suspend the run (raises Prefect's Pause).

    The server refuses a second Suspended state with the same key and the call
    returns the input saved under it instead: the same question gets the same
    answer on every re-run of this flow run. An expired suspension is failed
    by the server (nothing runs to time it out here).
    """
    from prefect.context import FlowRunContext
    from prefect.flow_runs import suspend_flow_run

    if question.key in (FlowRunContext.get().flow_run.empirical_policy.pause_keys or ()):
        log.info("%s: asked before this run was resumed; reading the answer", question.title)
    else:
        log.warning("%s: suspending the run: its process exits and frees the machine; Resume in the Prefect UI "
                    "within %d s (the run then starts again, skips the finished work and goes on)",
                    question.title, timeout)
    answer = suspend_flow_run(wait_for_input=model, timeout=timeout, key=question.key)
    log.info("%s: answered %s", question.title, answer.answer)
    return answer.answer


__all__ = ["QUESTION_KEY_LABEL", "QUESTION_LABEL", "ApprovalRefused", "ask"]
