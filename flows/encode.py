"""The encode-dataset flow: fetch -> verify existing -> sanity -> encode units -> audit -> finalize -> validate.

The flow only composes tasks; each task is a thin wrapper over diffprep/.
Tasks pass paths and small summaries, never tensors. ``run_pipeline`` holds
the phases; encode-raw (flows/raw.py) runs them with its own ``Pipeline``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from diffprep import contract
from diffprep.audit import AuditReport, rejects_accepted, rejects_question
from diffprep.decode import markdown_image
from diffprep.encode import sanity_markdown
from diffprep.config import EncodeParameters, Settings, check_runnable, load_settings
from diffprep.energon import split_question
from diffprep.errors import DiffprepError
from diffprep.existing import Inspection, clear_dead_temp_files, clear_output, decide
from diffprep.outputs import Output
from diffprep.workers import units_for_shard
from flows.runners import RUNNERS, Progress, runner_for
from diffprep.plan import read_plan, write_plan
from tasks.approvals import ask
from tasks.common import output_from, slug
from tasks.audit import audit_task
from tasks.fetch import fetch_task
from tasks.finalize import finalize_task
from tasks.sanity import sanity_task
from tasks.validate import validate_task
from tasks.verify import verify_existing_task


def resolve_settings(parameters: EncodeParameters) -> Settings:
    """Settings of a run: parameters given > encoder-spec block > env > YAML > defaults."""
    overrides = parameters.overrides()
    if parameters.encoder_spec:
        from blocks.encoder_spec import EncoderSpec

        spec = EncoderSpec.load(parameters.encoder_spec).model_settings()
        overrides["model"] = spec | overrides.get("model", {})
    settings = load_settings(parameters.config, overrides)
    check_runnable(settings)
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
    settings = resolve_settings(parameters or EncodeParameters())
    return run_pipeline(settings, Pipeline(contract.ENCODING_PREENCODED, fetch_task, sanity_task, _run_encoders))


@dataclass(frozen=True)
class Pipeline:
    """What encode-dataset and encode-raw (flows/raw.py) do differently; every other step is the same."""

    encoding: str
    fetch: Callable[[dict, str], dict]  # (settings, out_dir) -> plan summary with the staged plan_path
    sanity: Callable[[dict, str, list[int]], dict]  # (settings, out_dir, units_left) -> sanity report
    write_units: Callable[[Settings, dict, str, list[int], Progress], None]  # a flows.runners runner


def _run_encoders(settings: Settings, params: dict, out_dir: str, units: list[int], progress: Progress) -> None:
    runner = runner_for(settings)
    get_run_logger().info("encoding %d units with the %s runner", len(units), runner)
    RUNNERS[runner](settings, params, out_dir, units, progress)


def run_pipeline(settings: Settings, pipeline: Pipeline) -> dict:
    """fetch -> verify existing -> sanity -> units -> audit -> finalize -> validate, inside a flow run."""
    logger = get_run_logger()
    params = settings.model_dump(mode="json")
    timeout = settings.output.approval_timeout
    started = time.perf_counter()

    output = output_from(settings)
    out_dir = output.uri
    fetched = pipeline.fetch(params, out_dir)
    logger.info("planned %d samples in %d units (fingerprint %s)", fetched["samples"], fetched["units"],
                fetched["fingerprint"])
    if fetched["missing_from_source"]:
        logger.warning("%d planned samples are no longer in the source; nothing is removed from the dataset",
                       fetched["missing_from_source"])

    inspection = Inspection(**verify_existing_task(fetched["plan_path"], out_dir, params))
    on_existing = settings.output.on_existing
    if inspection.needs_choice and on_existing is None:
        on_existing = ask(inspection.question(), timeout=timeout)
    decision = decide(inspection, on_existing, output)
    if decision.out_dir != out_dir:
        output = output_from(settings, decision.out_dir)
    out_dir = output.uri
    logger.info("output %s: %s", out_dir, decision.action)
    result: dict[str, Any] = {"out_dir": out_dir, "action": decision.action, "fingerprint": fetched["fingerprint"]}
    if decision.action == "reuse":
        logger.info("reusing %s as it is: nothing encoded, nothing changed", out_dir)
        return result | {"seconds": round(time.perf_counter() - started, 1)}

    workers = settings.workers
    if workers.num_shards is not None and decision.action in ("overwrite", "new-dir"):
        raise DiffprepError(
            f"--shard-index runs only resume; decide about the existing output ({decision.action}) "
            "with a plain run first"
        )
    output.local.mkdir(parents=True, exist_ok=True)
    with output.lock(run=str(flow_run.get_id() or ""), shard=workers.shard_index):
        removed_temp = clear_dead_temp_files(output.local)
        if removed_temp:
            logger.info("removed temporary files of interrupted writers: %s", ", ".join(removed_temp))
        if workers.shard_index is None:  # holding the prefix alone: any unfinished upload is a dead run's
            aborted = output.abort_stale_uploads()
            if aborted:
                logger.info("aborted unfinished uploads of interrupted runs: %s", ", ".join(aborted))
        if decision.action == "overwrite":
            removed = clear_output(output)
            logger.warning("overwrite (approved): removed %s", ", ".join(removed) or "nothing")
        plan = read_plan(fetched["plan_path"])
        write_plan(output.local, plan)
        output.push(f"{contract.STATE_DIR}/{contract.PLAN_JSON}")
        if decision.action in ("resume", "complete"):
            units_left = sorted(inspection.units_left + inspection.damaged_units)
        else:
            units_left = [u.unit for u in plan.units]
        units_left = units_for_shard(units_left, workers.num_shards, workers.shard_index)
        _plan_artifact(plan, units_left, out_dir)

        sanity = None
        if units_left:
            with publish_sanity(output):
                sanity = pipeline.sanity(params, out_dir, units_left)
            logger.info(
                "sanity: %s s per batch, projected %.2f GiB and %.0f s for %d units; round-trip PSNR %s dB",
                sanity["seconds_per_batch"], sanity["projected_bytes"] / 2**30, sanity["projected_seconds"],
                len(units_left), sanity["psnr_db"],
            )
            pipeline.write_units(settings, params, out_dir, units_left,
                                 Progress(len(units_left), f"progress-{slug(out_dir)}"))
        else:
            logger.info("every unit is already encoded with these settings: nothing to encode")
        if workers.num_shards is not None:
            logger.info("shard %d of %d: %d units encoded; run a plain `diffprep encode` with the same settings "
                        "to audit and finalize", workers.shard_index, workers.num_shards, len(units_left))
            return result | {"shard": f"{workers.shard_index}/{workers.num_shards}", "encoded_units": len(units_left),
                             "units": len(plan.units), "seconds": round(time.perf_counter() - started, 1)}

        audit = AuditReport(**{k: v for k, v in audit_task(out_dir, params).items() if k != "ok"})
        create_table_artifact(
            key=f"audit-{slug(out_dir)}",
            table=[{"reason": r, "samples": n} for r, n in audit.by_reason.items()]
            or [{"reason": "(none)", "samples": 0}],
            description=audit.to_markdown(),
        )
        if audit.problems:
            raise DiffprepError("audit failed:\n  " + "\n  ".join(audit.problems))
        if not rejects_accepted(audit, settings.output.accept_rejects):
            ask(rejects_question(audit, out_dir), timeout=timeout)

        result |= {
            "units": len(plan.units),
            "encoded_units": len(units_left),
            "samples": audit.written,
            "rejected": audit.rejected,
            "rejects_by_reason": audit.by_reason,
            "notes": audit.notes,
            "sanity": sanity,
        }
        if settings.finalize.enabled:
            question = split_question(output, train_split=settings.finalize.train_split,
                                      seed=settings.finalize.shuffle_seed)
            replace = question is not None and ask(
                question, preset=settings.finalize.on_split_change, timeout=timeout) == "replace"
            result["finalize"] = finalize_task(params, out_dir, replace, pipeline.encoding)
            validation = validate_task(out_dir, pipeline.encoding, settings=params)
            result["validation"] = {"ok": validation["ok"], "summary": validation["summary"]}
        create_link_artifact(key=f"output-{slug(out_dir)}", link=output.link(),
                             link_text=out_dir, description="The encoded dataset")
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


@contextlib.contextmanager
def publish_sanity(output: Output) -> Iterator[None]:
    """Around the sanity task: its report and contact sheet as a Markdown artifact, whether it passed or failed."""
    out_dir = output.uri
    report = output.local / contract.STATE_DIR / contract.SANITY_DIR / "report.json"
    started = time.time()
    try:
        yield
    finally:
        # A report older than this run is a previous run's: a check that failed before writing one shows nothing.
        # (One second of slack for file systems with coarse timestamps.)
        if report.is_file() and report.stat().st_mtime >= started - 1:
            data = json.loads(report.read_text(encoding="utf-8"))
            picture = markdown_image(data["contact_sheet"]) if data.get("contact_sheet") else ""
            create_markdown_artifact(key=f"sanity-{slug(out_dir)}", markdown=sanity_markdown(data) + "\n" + picture,
                                     description="diffprep sanity check: one batch written and decoded again")


def _plan_artifact(plan, units_left: list[int], out_dir: str) -> None:
    left = set(units_left)
    rows = [{"unit": u.unit, "shard": u.shard, "samples": len(u.source_ids), "to encode": u.unit in left}
            for u in plan.units[:500]]
    create_table_artifact(key=f"plan-{slug(out_dir)}", table=rows,
                          description=f"{plan.total_samples} samples in {len(plan.units)} units, "
                                      f"{len(units_left)} to encode (fingerprint `{plan.fingerprint}`)")


logging.getLogger("diffprep").setLevel(logging.INFO)
