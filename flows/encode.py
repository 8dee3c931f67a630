"""The encode-dataset flow: fetch -> verify existing -> sanity -> encode units -> audit -> finalize -> validate.

The phases and their order are ``diffprep.phases.pipeline.run``'s; this flow runs
them as Prefect tasks (``TaskSteps``), asks its questions in the UI
(``diffprep.tasks.approvals.ask``) and publishes what a run reports as artifacts
(``ArtifactEvents``). encode-raw (flows/raw.py) is the same with the raw
encoding.
"""

from __future__ import annotations

import json
import logging

from prefect import flow, get_run_logger
from prefect.artifacts import Artifact, LinkArtifact, MarkdownArtifact, TableArtifact
from prefect.runtime import flow_run

from diffprep import contract
from diffprep.run.allocator import tune_malloc
from diffprep.phases.audit import AuditReport
from diffprep.config import EncodeParameters, Settings, check_runnable, load_settings
from diffprep.run.long_videos import scenes_markdown
from diffprep.report.pictures import markdown_image
from diffprep.output import Output, ref_of
from diffprep.phases.preflight import preflight
from diffprep.phases.pipeline import Events, Steps, run, settings_output
from diffprep.writer.plan import Plan
from diffprep.run.sanity import sanity_markdown
from diffprep.flows.runners import ArtifactProgress, run_units
from diffprep.tasks.approvals import ask
from diffprep.tasks.audit import audit_task
from diffprep.tasks.common import output_of, slug
from diffprep.tasks.encode import encode_unit_task
from diffprep.tasks.fetch import fetch_task
from diffprep.tasks.finalize import finalize_task
from diffprep.tasks.sanity import sanity_task
from diffprep.tasks.validate import validate_task
from diffprep.tasks.verify import prepare_output_task, verify_existing_task


def resolve_settings(parameters: EncodeParameters) -> Settings:
    """Settings of a run: parameters given > encoder-spec block > env > YAML > defaults."""
    overrides = parameters.overrides()
    if parameters.encoder_spec:
        from diffprep.blocks.encoder_spec import EncoderSpec

        spec = EncoderSpec.load(parameters.encoder_spec).model_settings()
        overrides["model"] = spec | overrides.get("model", {})
    settings = load_settings(parameters.config, overrides)
    check_runnable(settings)
    preflight(settings, contract.ENCODING_PREENCODED)  # before anything is written, the encoding's own checks too
    return settings


@flow(name="encode-dataset", log_prints=True)
def encode_dataset(parameters: EncodeParameters | None = None) -> dict:
    """Pre-encode a source into a validated Energon dataset.

    Existing data is changed only after an approval: a parameter given ahead
    of time, or an answer to the question the paused run asks in the UI.

    Args:
        parameters: The run's settings by section. Only the fields given count; the rest comes from the
            config file (``config``), the ``DIFFPREP_*`` environment of the worker, and the defaults.
    """
    # A run started by a worker or `diffprep serve` is a process of its own: mallopt settings are not inherited.
    tune_malloc()
    settings = resolve_settings(parameters or EncodeParameters())
    return run_flow(settings, contract.ENCODING_PREENCODED)


# Each phase as a task of this flow run; the tasks call the same library functions as a run without Prefect.
TASK_STEPS = Steps(
    plan=lambda settings, output, encoding: fetch_task(settings, ref_of(output), encoding),
    verify=lambda output, plan: verify_existing_task(ref_of(output), plan),
    prepare=lambda output, decision, inspection, plan, workers: prepare_output_task(ref_of(output), decision,
                                                                                   inspection, plan, workers),
    sanity=lambda settings, output, plan, units: sanity_task(settings, ref_of(output), plan, units),
    units=run_units,
    audit=lambda output, plan: audit_task(ref_of(output), plan),
    finalize=lambda output, encoding, config, replace: finalize_task(ref_of(output), encoding, config, replace),
    validate=lambda output, encoding: validate_task(ref_of(output), encoding),
)


# The tasks by name: a terminal run recorded afterwards (flows/recorded.py) writes its phases as runs of these.
TASKS_BY_NAME = {task.name: task for task in (fetch_task, verify_existing_task, prepare_output_task, sanity_task,
                                              encode_unit_task, audit_task, finalize_task, validate_task)}


def run_flow(settings: Settings, encoding: str) -> dict:
    """The pipeline for ``encoding`` inside this flow run: tasks, UI questions, artifacts."""
    timeout = settings.output.approval_timeout

    def ask_in_ui(question, preset=None, *, release=False):
        # release: a question after encoding suspends a deployment run (its process and GPU go back) instead of
        # pausing it (tasks.approvals.ask).
        return ask(question, preset, timeout=timeout, release=release)

    try:
        result = run(settings, encoding, output=output_of(settings_output(settings)), ask=ask_in_ui,
                     steps=TASK_STEPS, events=ArtifactEvents(), run_id=str(flow_run.get_id() or ""))
    except Exception as error:
        if interrupted(error):  # a Ctrl-C that Prefect's task engine turned into another error: still a Ctrl-C
            raise KeyboardInterrupt from error
        raise
    return result.to_json()


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` was raised while handling a KeyboardInterrupt (a Ctrl-C that lands while a task run is
    being created makes Prefect 3.9's crash handler raise ``ValueError: Task run is not set``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class ArtifactEvents(Events):
    """What a run reports, as artifacts of the flow run (and its log)."""

    def publish(self, artifact: Artifact) -> None:
        artifact.create(_sync=True)  # the flow's own code is synchronous; as create_table_artifact calls it

    def log(self, message: str, *args) -> None:
        get_run_logger().info(message, *args)

    def planned(self, plan: Plan, units_left: list[int], output: Output) -> None:
        self.log("planned %d samples in %d units (fingerprint %s), %d to encode", plan.total_samples,
                 len(plan.units), plan.fingerprint, len(units_left))
        left = set(units_left)
        rows = [{"unit": u.unit, "shard": u.shard, "samples": u.count, "to encode": u.unit in left}
                for u in plan.units[:500]]
        self.publish(TableArtifact(key=f"plan-{slug(output.uri)}", table=rows,
                                   description=f"{plan.total_samples} samples in {len(plan.units)} units, "
                                               f"{len(units_left)} to encode (fingerprint `{plan.fingerprint}`)"))
        if plan.scenes:  # long videos: sources, shots, clips per bucket, frames in no clip (before any model loads)
            self.publish(MarkdownArtifact(key=f"scenes-{slug(output.uri)}", markdown=scenes_markdown(plan.scenes),
                                          description="diffprep long videos: the shots and clips of every source"))

    def sanity(self, output: Output, started: float) -> None:
        """The sanity report and contact sheet as a Markdown artifact, whether the check passed or failed."""
        report = output.state.local_copy(f"{contract.SANITY_DIR}/{contract.SANITY_REPORT}")
        # A report older than this run is a previous run's: a check that failed before writing one shows nothing.
        # (One second of slack for file systems with coarse timestamps.)
        if report is not None and report.stat().st_mtime >= started - 1:
            data = json.loads(report.read_text(encoding="utf-8"))
            picture = markdown_image(data["contact_sheet"]) if data.get("contact_sheet") else ""
            self.publish(MarkdownArtifact(key=f"sanity-{slug(output.uri)}",
                                          markdown=sanity_markdown(data) + "\n" + picture,
                                          description="diffprep sanity check: one batch written and decoded again"))

    def progress(self, units: int, output: Output) -> ArtifactProgress:
        return ArtifactProgress(units, f"progress-{slug(output.uri)}")

    def audited(self, report: AuditReport, output: Output) -> None:
        self.publish(TableArtifact(
            key=f"audit-{slug(output.uri)}",
            table=[{"reason": r, "samples": n} for r, n in report.by_reason.items()]
            or [{"reason": "(none)", "samples": 0}],
            description=report.to_markdown(),
        ))

    def done(self, output: Output) -> None:
        self.publish(LinkArtifact(key=f"output-{slug(output.uri)}", link=output.link(), link_text=output.uri,
                                  description="The encoded dataset"))


logging.getLogger("diffprep").setLevel(logging.INFO)
