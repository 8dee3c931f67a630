"""Progress inside a unit: a rate-limited line with samples/s and the unit's ETA, and the flow's artifact moving."""

from __future__ import annotations

import logging

import pytest

from diffprep.run import unit_progress
from diffprep.phases.fetch import fetch
from diffprep.output import Output
from diffprep.phases.pipeline import encode_one_unit
from diffprep.writer.plan import write_plan
from diffprep.run.unit_progress import UnitProgress, UnitStatus


class Lines(logging.Handler):
    """The messages of ``diffprep.run.units`` (a handler of its own: Prefect's logging config may stop propagation)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lines():
    handler, logger = Lines(), logging.getLogger("diffprep.units")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_at_most_every_few_seconds_with_rate_and_eta(lines):
    clock, heard = Clock(), []
    progress = UnitProgress(every=10, listener=heard.append, clock=clock)
    for seconds, done in ((4, 40), (8, 80), (12, 120), (16, 160), (25, 250), (100, 1000)):
        clock.now = 100.0 + seconds
        progress({"unit": 3, "samples": done, "total": 1000})
    assert lines == [
        "unit 000003: 120 of 1000 samples, 10.0 samples/s, ETA 88 s for this unit",
        "unit 000003: 250 of 1000 samples, 10.0 samples/s, ETA 75 s for this unit",
    ]  # 12 s and 25 s in; nothing at 16 s (too soon) nor when the unit is whole (its own line says so)
    assert heard == [UnitStatus(3, 120, 1000, 12.0), UnitStatus(3, 250, 1000, 25.0)]


@pytest.fixture
def planned(tmp_path, tiny_model, demo_data, settings_for):
    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"shard_size": 8}, model={"batch_size": 2})
    plan, _source = fetch(settings)
    write_plan(out, plan)
    return Output(out), settings, plan


def test_encoding_a_unit_reports_inside_it_and_moves_the_flows_artifact(planned, monkeypatch, lines):
    from diffprep.flows import runners

    monkeypatch.setattr(unit_progress, "PROGRESS_SECONDS", 0.0)
    output, settings, plan = planned
    updates = []
    monkeypatch.setattr(runners, "create_progress_artifact", lambda **kwargs: "artifact-id")
    monkeypatch.setattr(runners, "update_progress_artifact", lambda **kwargs: updates.append(kwargs))
    monkeypatch.setattr(runners, "encode_unit_task", lambda settings, ref, unit: {
        **vars(encode_one_unit(settings, output, plan, unit)), "worker": "here"})
    progress = runners.ArtifactProgress(2, "progress-test")
    monkeypatch.setattr(progress, "log", lambda *args: None)
    runners.in_process(settings, output, plan, [0, 1], progress)  # 12 demo samples: units of 8 and 4
    inside = [line.split(", ")[0] for line in lines if "samples/s, ETA" in line]
    assert inside == [f"unit 000000: {n} of 8 samples" for n in (2, 4, 6)] + ["unit 000001: 2 of 4 samples"]
    within = [u for u in updates if "description" in u]
    assert [round(u["progress"], 1) for u in within] == [12.5, 25.0, 37.5, 75.0]
    assert "1 done; unit 000001 at 2/4 samples" in within[-1]["description"] and "ETA" in within[-1]["description"]
    assert updates[-1] == {"artifact_id": "artifact-id", "progress": 100.0}  # the second unit done
