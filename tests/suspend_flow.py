"""A small flow shaped like encode-dataset's end, for tests/test_suspend.py: committed units, then a question.

Each attempt of the run appends its process id to ``attempts``; each unit it
encodes appends to ``encoded`` and commits ``unit-N.done`` (a unit manifest's
stand-in), and a committed unit is skipped, as encode-dataset's verify step
skips units with a manifest. Then it asks, releasing its process while it waits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prefect import flow

from diffprep.run.approvals import Question
from diffprep.tasks.approvals import ask

QUESTION = Question(
    key="rejects",
    title="2 of 6 samples rejected",
    description="| reason | samples |\n|---|---|\n| corrupt image | 2 |\n\nAccept to finalize without them.",
    choices=("accept", "abort"),
    preset_hint="--accept-rejects 0.34",
)

logging.getLogger("diffprep").setLevel(logging.INFO)  # as flows/encode.py does


@flow(name="diffprep-suspend-test")
def units_then_question(work_dir: str, units: int = 3, release: bool = True, timeout: int = 600) -> str:
    work = Path(work_dir)
    with (work / "attempts").open("a") as attempts:
        attempts.write(f"{os.getpid()}\n")
    for unit in range(units):
        done = work / f"unit-{unit}.done"
        if done.exists():
            continue
        with (work / "encoded").open("a") as encoded:
            encoded.write(f"{unit}\n")
        done.write_text("committed")
    answer = ask(QUESTION, timeout=timeout, release=release)
    (work / "answer").write_text(answer)
    return answer
