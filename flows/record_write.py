"""Writing a terminal run's record (flows/recorded.py) to the server, as the flow run the flow would have made.

A record stays bounded whatever the dataset's size: a task run per phase, a task run per unit for the first
``DIFFPREP_RECORD_UNITS`` units (100 by default) and every failed unit up to that many again, and one task run
for the other units together (``encode-unit`` over their range, with their count, span and workers), so that a
100,000-unit run writes a few hundred task runs, not 100,000 (~40 min of API calls on 2 cores). The log lines
are capped as they are kept (``MAX_LOG_LINES``); the progress artifact has every unit's count either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("diffprep.recorded")

MAX_LOG_LINES = 20_000
RECORD_UNITS_ENV = "DIFFPREP_RECORD_UNITS"
RECORD_UNITS = 100
UNIT_TASK = "encode-unit"


@dataclass
class TaskRecord:
    """One phase or unit as the task run the flow would have made."""

    task: str  # the task's name in ``diffprep.tasks``
    name: str  # its run's name
    started: float
    ended: float = 0.0
    error: BaseException | None = None
    worker: str = ""  # a unit's: the process that encoded it (``host:pid/device``), when the units were shared



def final_state(error: BaseException | None, ran: str = "") -> Any:
    """The state a run or task ended in; ``ran`` (when it ran: the server stamps a state with the time it is
    recorded) leads its message."""
    from prefect.states import Completed, Crashed, Failed

    lead = f"{ran}; " if ran else ""
    if error is None:
        return Completed(message=ran or None)
    if isinstance(error, KeyboardInterrupt):
        return Crashed(message=f"{lead}interrupted (Ctrl-C); a re-run resumes from the committed units")
    return Failed(message=f"{lead}{type(error).__name__}: {error}")


def _ran(started: float, ended: float, what: str = "ran") -> str:
    clock = datetime.fromtimestamp(started).strftime("%H:%M:%S.%f")[:-3]
    return f"{what} at {clock} for {ended - started:.1f} s (recorded after the run)"


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def write_flow_run(recorder: Any, flow: Any, parameters: dict[str, Any], error: BaseException | None) -> Any:
    """The run as the flow would have left it on the server: flow run, task runs, artifacts, logs, final state
    (``recorder``: the run's ``flows.recorded.Recorder``).

    The server stamps every state with the time it receives it (the API takes no timestamp), so each state's
    message says when its run really ran; the log lines keep their own times."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate, LogCreate
    from prefect.states import Running

    from diffprep.flows.encode import TASKS_BY_NAME

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(flow, parameters=parameters, tags=["recorded"], state=Running())
        # The artifacts first: the client sends an event for each in the background, which has then had the rest
        # of the recording to go out (sent at exit, they hold it up with a "still processing" warning).
        for artifact in recorder.artifacts:
            client.create_artifact(ArtifactCreate(key=artifact.key, type=artifact.type,
                                                  description=artifact.description, data=artifact.format(_sync=True),
                                                  flow_run_id=flow_run.id))
        tasks, where = folded(recorder.tasks, unit_limit())
        ids: list[Any] = []
        for index, task in enumerate(tasks):
            task_run = client.create_task_run(TASKS_BY_NAME[task.task], flow_run.id, f"{task.name}-{index}",
                                              name=task.name, state=Running())
            # A task the run's end cut short (a worker's unit at a Ctrl-C) ended with the run, as the run did.
            ended, ended_error = (task.ended, task.error) if task.ended else (recorder.ended, task.error or error)
            ran = _ran(task.started, ended, f"ran on {task.worker}" if task.worker else "ran")
            client.set_task_run_state(task_run.id, final_state(ended_error, ran), force=True)
            ids.append(task_run.id)
        client.create_logs([LogCreate(name=record.name, level=record.levelno, message=_message(record),
                                      timestamp=_at(record.created), flow_run_id=flow_run.id,
                                      task_run_id=ids[where[task]] if task is not None else None)
                            for record, task in recorder.logs])
        if recorder.dropped:
            client.create_logs([LogCreate(name=log.name, level=logging.WARNING, timestamp=_at(recorder.ended),
                                          message=f"{recorder.dropped} more log lines of this run were not recorded "
                                                  f"(at most {MAX_LOG_LINES}); the terminal showed them",
                                          flow_run_id=flow_run.id)])
        ended = final_state(error, _ran(recorder.started, recorder.ended, "ran without a server"))
        client.set_flow_run_state(flow_run.id, ended, force=True)
    return flow_run


def _message(record: logging.LogRecord) -> str:
    message = record.getMessage()
    if record.exc_info:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    return message


def unit_limit() -> int:
    """How many units keep a task run of their own (``DIFFPREP_RECORD_UNITS``, default 100)."""
    value = os.environ.get(RECORD_UNITS_ENV, "")
    return int(value) if value.strip().isdigit() else RECORD_UNITS


def folded(tasks: list[TaskRecord], limit: int) -> tuple[list[TaskRecord], list[int]]:
    """``tasks`` with the units past ``limit`` (failed units: past ``limit`` more) folded into one task run placed
    where the first of them was; returns the task runs to write and, per original task, the index of the one that
    holds it now (the log lines follow their task)."""
    units = [i for i, task in enumerate(tasks) if task.task == UNIT_TASK]
    if len(units) <= limit:
        return list(tasks), list(range(len(tasks)))
    failed = [i for i in units if tasks[i].error is not None][:limit]
    kept = set(units[:limit]) | set(failed)
    rest = [i for i in units if i not in kept]
    first, last = tasks[rest[0]], tasks[rest[-1]]
    workers = sorted({tasks[i].worker for i in rest if tasks[i].worker})
    span = first.name if first is last else f"{first.name}..{last.name.rsplit('-', 1)[-1]}"
    summary = TaskRecord(
        UNIT_TASK, f"{span} ({len(rest)} unit{'s' if len(rest) > 1 else ''}, one task run: {RECORD_UNITS_ENV}={limit})",
        min(tasks[i].started for i in rest), max(tasks[i].ended for i in rest) if all(tasks[i].ended for i in rest)
        else 0.0, worker=", ".join(workers))
    out: list[TaskRecord] = []
    where: list[int] = []
    summary_at = None
    for i, task in enumerate(tasks):
        if i in rest:
            if summary_at is None:
                summary_at = len(out)
                out.append(summary)
            where.append(summary_at)
        else:
            where.append(len(out))
            out.append(task)
    return out, where


__all__ = ["MAX_LOG_LINES", "TaskRecord", "final_state", "folded", "write_flow_run"]
