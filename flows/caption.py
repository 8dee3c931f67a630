"""The caption-dataset flow: plan -> verify the set -> sanity (one sample, shown) -> caption units -> audit -> written.

The phases and their order are ``diffprep.captions.run.run_caption``'s; this flow runs them as Prefect tasks
(``tasks/caption.py``), asks its questions in the UI (``diffprep.tasks.approvals.ask``) and publishes the
sanity sample's frames and captions, the audit and the token report as artifacts. A terminal run without
``PREFECT_API_URL`` runs the same phases in the command and is recorded afterwards as a run of this flow, as an
encode is (``flows/recorded.py``: ``run_caption_recorded``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from prefect import flow
from prefect.artifacts import Artifact, LinkArtifact, MarkdownArtifact, TableArtifact

from diffprep.captions.pipeline import CaptionAudit, CaptionJob, CaptionSanity
from diffprep.captions.run import CaptionEvents, CaptionSteps, ask_here, run_caption, sanity_here, units_here
from diffprep.captions.sets import CaptionSet, SetPlan
from diffprep.captions.tokens import tokens_markdown
from diffprep.config import SourceConfig
from diffprep.report.pictures import markdown_image
from diffprep.tasks.common import slug

log = logging.getLogger("diffprep.captions")


def job_to_json(job: CaptionJob) -> dict[str, Any]:
    """The flow's parameter (the Hugging Face token is never a parameter: it is resolved where the run runs)."""
    data = asdict(job) | {"source": job.source.model_dump(mode="json", exclude_defaults=True)}
    data.pop("hf_token")
    return data


def job_from_json(data: dict[str, Any]) -> CaptionJob:
    from diffprep.families.hub import resolve_token

    return CaptionJob(**(data | {"source": SourceConfig(**data.get("source", {}))}), hf_token=resolve_token(None))


@flow(name="caption-dataset", log_prints=True)
def caption_dataset(job: dict) -> dict:
    """Caption a source's images and clips into a named caption set beside the data.

    Args:
        job: the run (``diffprep caption``'s flags): name, source, captioning settings, instructions, devices,
            unit size, token families, and the answers given ahead of time (on_existing, on_replace_files).
    """
    from diffprep.tasks import caption as tasks
    from diffprep.tasks.approvals import ask

    settings = job_from_json(job)

    def ask_in_ui(question, preset=None, *, release=False):
        return ask(question, preset, timeout=3600, release=release)

    steps = CaptionSteps(plan=tasks.plan_task, verify=tasks.verify_task, prepare=tasks.prepare_task,
                         sanity=tasks.sanity_task, units=tasks.units_as_tasks, audit=tasks.audit_task,
                         write=tasks.write_task)
    return run_caption(settings, ask=ask_in_ui, steps=steps, events=ArtifactEvents())


class ArtifactEvents(CaptionEvents):
    """What a caption run reports, as artifacts of the flow run (and its log)."""

    def publish(self, artifact: Artifact) -> None:
        artifact.create(_sync=True)

    def planned(self, cset: CaptionSet, plan: SetPlan, units_left: list[int]) -> None:
        super().planned(cset, plan, units_left)
        self.publish(MarkdownArtifact(key=f"caption-plan-{slug(cset.name)}", markdown=(
            f"caption set **{cset.name}** at `{cset.path}`: {plan.samples} samples in {plan.units} units, "
            f"{len(units_left)} to caption (fingerprint `{plan.fingerprint}`)")))

    def sanity(self, cset: CaptionSet, report: CaptionSanity) -> None:
        super().sanity(cset, report)
        captions = "\n".join(f"{i}. {c}" for i, c in enumerate(report.captions, 1))
        picture = markdown_image(report.picture, alt=f"{report.source_id}: {report.frames} frame(s)") \
            if report.picture else ""
        self.publish(MarkdownArtifact(key=f"caption-sanity-{slug(cset.name)}", markdown=(
            f"### {report.source_id}\n\n{captions}\n\n{report.seconds} s for this sample; projected "
            f"{report.projected_seconds:.0f} s for the units left\n\n{picture}"),
            description="diffprep caption sanity check: one sample's frames and captions"))

    def audited(self, cset: CaptionSet, audit: CaptionAudit) -> None:
        super().audited(cset, audit)
        self.publish(TableArtifact(key=f"caption-audit-{slug(cset.name)}",
                                   table=[{"reason": r, "samples": n} for r, n in audit.by_reason.items()]
                                   or [{"reason": "(none)", "samples": 0}],
                                   description=f"{audit.captioned} captioned, {audit.rejected} rejected of "
                                               f"{audit.samples}"))

    def written(self, cset: CaptionSet, result: dict) -> None:
        self.publish(MarkdownArtifact(key=f"caption-tokens-{slug(cset.name)}",
                                      markdown=tokens_markdown(result.get("tokens") or {}),
                                      description="caption lengths against each family's text encoder"))
        self.publish(LinkArtifact(key=f"caption-set-{slug(cset.name)}", link=f"file://{cset.path}",
                                  link_text=cset.path, description="The caption set"))


def run_caption_recorded(job: CaptionJob) -> dict:
    """The caption run in this process, then recorded as a caption-dataset flow run on the embedded server."""
    from diffprep.flows.recorded import Recorder, ServerStart, retried
    from diffprep.tasks.common import FETCH_RETRY_DELAYS, UNIT_RETRY_DELAYS

    logging.getLogger("diffprep").setLevel(logging.INFO)
    server = ServerStart()
    recorder = Recorder()

    def units(job: CaptionJob, cset: CaptionSet, plan: SetPlan, left: list[int], done) -> None:
        from diffprep.run import launch

        if job.devices or launch.group() is not None:  # shared with worker processes or ranks: one task for them
            with recorder.task("caption-units"):
                units_here(job, cset, plan, left, done)
            return
        for unit in left:
            with recorder.task("caption-unit", f"caption-unit-{unit:06d}", unit=unit):
                retried(lambda: units_here(job, cset, plan, [unit], done), f"unit {unit}", UNIT_RETRY_DELAYS)

    base = CaptionSteps()
    steps = CaptionSteps(plan=recorder.timed("caption-plan", base.plan, FETCH_RETRY_DELAYS),
                         verify=recorder.timed("caption-verify", base.verify),
                         prepare=recorder.timed("caption-prepare", base.prepare),
                         sanity=recorder.timed("caption-sanity", sanity_here), units=units,
                         audit=recorder.timed("caption-audit", base.audit),
                         write=recorder.timed("caption-write", base.write))

    class RecordedEvents(ArtifactEvents):
        def publish(self, artifact: Artifact) -> None:
            recorder.artifacts.append(artifact)

    diffprep_log = logging.getLogger("diffprep")
    diffprep_log.addHandler(recorder)
    parameters = {"job": job_to_json(job)}
    try:
        result = run_caption(job, ask=ask_here, steps=steps, events=RecordedEvents())
    except BaseException as error:
        diffprep_log.removeHandler(recorder)
        recorder.ended = time.time()
        server.record(recorder, caption_dataset, parameters, error, tasks_by_name())
        raise
    diffprep_log.removeHandler(recorder)
    recorder.ended = time.time()
    server.record(recorder, caption_dataset, parameters, None, tasks_by_name())
    return result


def tasks_by_name() -> dict[str, Any]:
    """The flow's tasks by name, for the recording (the phases with several devices are one task: the units')."""
    from diffprep.tasks.caption import TASKS, caption_units_task

    return {task.name: task for task in (*TASKS, caption_units_task)}


def run_command(job: CaptionJob) -> dict:
    """``diffprep caption``: the flow on the server PREFECT_API_URL names, else here and recorded afterwards."""
    from prefect.settings import PREFECT_API_URL

    return run_live(job) if PREFECT_API_URL.value() else run_caption_recorded(job)


def run_live(job: CaptionJob) -> dict:
    """The flow on the Prefect server PREFECT_API_URL names (its questions in the UI)."""
    return caption_dataset(job_to_json(job))


logging.getLogger("diffprep").setLevel(logging.INFO)
