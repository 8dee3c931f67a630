"""The "diffprep run waits for an answer" automation: a notification when a run pauses or is suspended.

A run that asks a question (tasks/approvals.py) waits in state Paused (its
process polls) or Suspended (no process) until someone answers in the UI; a
scheduled run does so unseen. This automation reacts to the server's
``prefect.flow-run.Paused`` / ``prefect.flow-run.Suspended`` events of the
flows that ask (encode-dataset, encode-raw) and sends the question's title and
a link to the run through a notification block the user has saved (Slack,
email, a custom webhook...). ``configs/prefect/automation-approval.yaml`` is the same
definition for ``prefect automation create --from-file``.

The link is ``{{ flow_run|ui_url }}``, built from the server process's
``PREFECT_UI_URL`` (else its ``PREFECT_API_URL`` without ``/api``). ``prefect
server start`` sets neither: without one the message names the flow run id
instead of a link. Start the server with ``PREFECT_UI_URL`` set to the address
users open.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Sequence

from diffprep.errors import ConfigError
from diffprep.tasks.approvals import QUESTION_KEY_LABEL, QUESTION_LABEL

if TYPE_CHECKING:
    from prefect.automations import Automation

AUTOMATION_NAME = "diffprep: a run waits for an answer"
ASKING_FLOWS = ("encode-dataset", "encode-raw")  # the flows that ask questions
WAITING_EVENTS = ("prefect.flow-run.Paused", "prefect.flow-run.Suspended")

SUBJECT = "diffprep: {{ flow_run.name }} waits for an answer"
BODY = (
    '{{ flow_run.labels["' + QUESTION_LABEL + '"] | default("A question", true) }}'
    ' (question: {{ flow_run.labels["' + QUESTION_KEY_LABEL + '"] | default("?", true) }})\n\n'
    "The run {{ flow_run.name }} is {{ flow_run.state.name }} until someone answers: "
    "open it, press Resume and choose an answer.\n"
    "{{ flow_run|ui_url or 'flow run ' ~ flow_run.id ~ ' (no link: set PREFECT_UI_URL where the server runs)' }}\n\n"
    "Paused: its process keeps waiting. Suspended: it holds no process or GPU and starts again, "
    "skipping finished work, once answered. Unanswered, it ends after output.approval_timeout "
    "having changed nothing."
)


def approval_automation(block_document_id, *, flows: Sequence[str] = ASKING_FLOWS,
                        name: str = AUTOMATION_NAME) -> "Automation":
    """The automation (not yet created): runs of ``flows`` entering Paused/Suspended -> that notification block."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    return Automation(
        name=name,
        description="A diffprep run waits for an approval: notify with the question and a link to the run.",
        trigger=EventTrigger(
            expect=set(WAITING_EVENTS),
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flows)},
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[SendNotification(block_document_id=block_document_id, subject=SUBJECT, body=BODY)],
    )


def notification_block_id(block: str):
    """The id of the saved notification block ``block``: ``NAME`` or ``TYPE-SLUG/NAME``."""
    from prefect.client.orchestration import get_client

    slug, _, name = block.rpartition("/")
    with get_client(sync_client=True) as client:
        saved = [d for d in client.read_block_documents() if d.block_type is not None]

    def notifies(document) -> bool:
        return document.block_schema is not None and "notify" in document.block_schema.capabilities

    named = [d for d in saved if d.name == name and (not slug or d.block_type.slug == slug)]
    notifiers = [d for d in named if notifies(d)]
    if len(notifiers) == 1:
        return notifiers[0].id
    if len(notifiers) > 1:
        raise ConfigError(f"{len(notifiers)} notification blocks are named {name!r}: give TYPE/NAME, one of "
                          f"{', '.join(f'{d.block_type.slug}/{d.name}' for d in notifiers)}")
    if named:
        raise ConfigError(f"block {block!r} is a {named[0].block_type.name} block, not a notification block")
    choices = ", ".join(sorted(f"{d.block_type.slug}/{d.name}" for d in saved if notifies(d)))
    raise ConfigError(f"no notification block named {block!r} on this server; saved notification blocks: "
                      f"{choices or 'none (save one in the UI: Blocks -> +, e.g. Slack Webhook)'}")


def create_approval_automation(block: str, *, flows: Sequence[str] = ASKING_FLOWS,
                               name: str = AUTOMATION_NAME) -> "Automation":
    """Create the automation on the server (``PREFECT_API_URL``), replacing one of the same name.

    ``block``: the saved notification block to send through, ``NAME`` or ``TYPE-SLUG/NAME``.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:  # else Prefect starts a throwaway embedded server
        raise ConfigError("creating the automation needs the Prefect server your runs use: set PREFECT_API_URL "
                          "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)")
    automation = approval_automation(notification_block_id(block), flows=flows, name=name)
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)
    return automation.create()


def cmd_automation_create(block: str) -> int:
    """``diffprep automation create --block NAME``: create it and say what it does (ConfigError: exit 2)."""
    created = create_approval_automation(block)
    print(f"created automation {created.name!r} ({created.id}): encode-dataset and encode-raw runs that pause or "
          f"are suspended for an answer notify through block {block!r} with the question and a link to the run.")
    return 0


__all__ = ["AUTOMATION_NAME", "ASKING_FLOWS", "approval_automation", "cmd_automation_create",
           "create_approval_automation",
           "notification_block_id"]
