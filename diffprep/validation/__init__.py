"""Strict validation of a finalized dataset: ``python -m diffprep.validation OUT``.

The checks (``checks.py``) are functions of an immutable description of the
dataset (``dataset.py``); each returns its findings as ``Check``s, nothing is
only logged. Every shard's headers, count and digest are checked; of its
samples, one drawn from every shard is loaded and judged by default, every one
with ``full`` (``loading.py``: in processes with ``workers``, the same report).
This module runs them in order and is the only one that writes:
``.diffprep/validation.json``, and when every check passed the per-channel
latent statistics (``.diffprep/latent_stats.pt``): the units' saved moments
merged (with the full covariance after ``--full-cov``), checked against the
inspector's own pass; the inspector's where no unit saved any.

The summary also holds the reject counts of ``.diffprep/audit.json`` and
previews: a few samples decoded (latents through the dataset's VAE, raw
images as stored) next to their re-read sources, their PSNR, and a contact
sheet at ``.diffprep/contact_sheet.png``. Previews inform, they never fail the
validation: without a reachable VAE or source they are skipped with a note.

Tensors are only ever loaded with ``torch.load(weights_only=True)`` (in the
cooker): a shard holding a pickle that would run code fails validation
instead of running it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from diffprep import contract
from diffprep.report.checks import Check
from diffprep.encodings import get_encoding
from diffprep.encodings.ltx_layout import dataset_root
from diffprep.errors import ConfigError, DiffprepError, SourceError
from diffprep.writer.layouts import Layout
from diffprep.output import Output, OutputRef, as_output
from diffprep.validation.ownership import refuse_links
from diffprep.validation.checks import Progress, check_layout_files, check_loading, check_shards, check_splits
from diffprep.validation.dataset import normalize_expected, read_dataset
from diffprep.validation.loading import check_drawn, load_in_processes
from diffprep.report.validation import ValidationReport


def validate_dataset(
    output: Output | str | os.PathLike,
    *,
    encoding: str | None = None,
    expected: dict[str, Any] | None = None,
    max_load: int | None = None,
    progress: Progress | None = None,
    previews: int = 4,
    full: bool = False,
    workers: int = 1,
) -> ValidationReport:
    """Check a finalized output; never raises for a problem in the data, reports it.

    ``encoding`` defaults to the one in dataset.yaml (a different value fails).
    ``expected`` (keys ``latents``, ``prompt_embeds``, ``pooled_prompt_embeds``:
    shapes with None for a free dimension, or None for any latent size;
    ``dtype``: e.g. ``"bfloat16"``) defaults to ``plan.json``'s ``expected``,
    else to the first sample's shapes (latent height and width free).
    Every shard's structure and count are checked from its tar headers and
    index; of its samples, one drawn from every shard is loaded by default
    (``diffprep.validation.loading.drawn_index``), every sample with ``full``
    (through Energon's loader, or read by ``workers`` processes for a folder:
    the same report), the first ``max_load`` per split with ``max_load``. The
    summary's ``loaded`` says which. ``progress(stage, done, total)`` is called
    as work advances. ``previews`` samples are decoded and compared with their
    sources into ``.diffprep/contact_sheet.png`` (0: none). Raises
    ConfigError only for invalid arguments.

    ``output`` may be a bucket prefix's ``Output``: the dataset is then
    validated in place, its shards read back from the bucket and loaded
    through Energon's Multi-Storage Client access.
    """
    if encoding is not None:
        get_encoding(encoding)
    if max_load is not None and max_load < 1:
        raise ConfigError(f"max_load must be >= 1 (or None for every sample), got {max_load}")
    if max_load is not None and full:
        raise ConfigError("full loads every sample and max_load limits them per split: pass one of them")
    if workers < 1 or (workers > 1 and not full):
        raise ConfigError(f"workers ({workers}) is the number of processes that load every sample: pass it with "
                          "full (--full), 1 or more")
    if previews < 0:
        raise ConfigError(f"previews must be >= 0 (0: none), got {previews}")
    if expected is not None:
        expected = normalize_expected(expected, "the expected argument") | {"source": "argument"}
    output = as_output(output)
    if output.remote:
        if not output.exists():
            return _report(output, [Check("metadata", False, f"{output.uri} holds no objects")], {})
    elif not output.local.is_dir():
        return _report(output, [Check("metadata", False, f"{output.local} is not a directory")], {})

    # A trainer's own folders (the LTX layout) or archive (edm-zip), read as that trainer reads them. (A plan.json
    # may hold only the ``expected`` shapes: the layout decides whether it must be a whole plan.)
    recorded = output.state.read_json(contract.PLAN_JSON) or {}
    if Layout.of_plan(recorded.get("settings")).name in (contract.LAYOUT_LTX, contract.LAYOUT_EDM_ZIP,
                                                          contract.LAYOUT_GAE):
        plan = output.state.plan()
        return _own_folders_stats(output, plan, get_encoding(plan.encoding).own_folders(plan).validate(output, plan))
    summary: dict[str, Any] = {"max_load": max_load} if max_load is not None else {}
    dataset, metadata = read_dataset(output, encoding, expected)
    summary["encoding"] = dataset.encoding
    checks = [metadata]
    split_checks, split_summary = check_splits(dataset)
    checks += split_checks
    summary.update(split_summary)
    shard_checks, shard_summary = check_shards(dataset, output, _encoding(dataset.encoding), progress)
    checks += shard_checks + check_layout_files(dataset, output)
    summary.update(shard_summary)
    inspector = None
    if dataset.info is not None and dataset.split_of is not None and dataset.encoding is not None:
        encoding_of = get_encoding(dataset.encoding)
        inspector = encoding_of.inspector(dataset.expected)
        splits = summary.get("splits", {})
        if max_load is not None or (full and (workers == 1 or output.remote)):
            checks += check_loading(dataset, output, encoding_of, inspector, splits, max_load, progress)
            how = (f"the first {max_load} of each split" if max_load is not None
                   else "every sample, through Energon's loader")
        elif full:
            checks += load_in_processes(dataset, output, encoding_of, inspector, splits, workers, progress)
            how = "every sample, through Energon's loader"
        else:
            checks += check_drawn(dataset, output, encoding_of, inspector, splits, progress)
            how = "one drawn from each shard (--full: every sample)"
        summary["loaded"] = {"samples": sum(s.get("loaded", 0) for s in splits.values()), "how": how}
        summary.update(inspector.summary())

    ours = set(dataset.info or {}) | set(dataset.committed)
    foreign = sorted(name for name in output.entries() if name.endswith((".tar", ".tgz")) and name not in ours)
    if foreign:
        summary["foreign"] = foreign
    recorded = output.state.read_json(contract.AUDIT_JSON)
    if recorded is not None:
        summary["rejects"] = {key: recorded[key] for key in ("inputs", "rejected", "by_reason")}
    if previews and dataset.manifests:
        summary["previews"] = (
            {"note": "no previews for a bucket prefix: decode a few samples with `diffprep decode` on a copy"}
            if output.remote else _previews(output, previews))
    if inspector is not None and checks and all(check.ok for check in checks):
        passed_checks, passed_summary, files = inspector.passed()
        unit_checks, unit_summary, unit_files = _unit_stats(output, files, full)
        if not full and contract.LATENT_STATS in unit_files:  # those written cover every sample, not the loaded
            passed_checks, passed_summary = _of_every_sample(passed_checks, passed_summary,
                                                             unit_files[contract.LATENT_STATS])
        files |= unit_files
        passed_checks += unit_checks
        passed_summary = _with_units_stats(passed_summary, unit_summary)
        passed_checks += _write_state(output, output.state.plan(), files)
        checks += passed_checks
        summary.update(passed_summary)
    return _report(output, checks, summary)


def _unit_stats(output: Output, files: dict[str, bytes], every_sample: bool
                ) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
    """The units' merged latent moments as the statistics file, checked against validation's own pass when it
    loaded every sample (``diffprep.report.latent_stats.finalized_stats``)."""
    from diffprep.report.latent_stats import finalized_stats

    plan = output.state.plan()
    if plan is None:
        return [], {}, {}
    return finalized_stats(output, plan, files.get(contract.LATENT_STATS) if every_sample else None)


def _of_every_sample(checks: list[Check], summary: dict[str, Any], data: bytes
                     ) -> tuple[list[Check], dict[str, Any]]:
    """The latent statistics check and summary of a validation that loaded some samples only, where the units
    saved their moments: the file written is the units' merge over every sample, and the report says its mean and
    std, not those of the loaded samples."""
    import io

    import torch

    stats = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if "mean" not in stats:  # audio only: kept as the loaded samples' (the summary names its own field)
        return checks, summary
    line = {"mean": [float(v) for v in stats["mean"]], "std": [float(v) for v in stats["std"]],
            "count": int(stats["count"]), "samples": int(stats["samples"])}
    if "of" in stats:  # a posterior's statistics name the half they are of
        line["of"] = stats["of"]
    detail = (f"per-channel mean/std of every sample (the units' moments merged) saved to "
              f"{contract.STATE_DIR}/{contract.LATENT_STATS}")
    checks = [Check(c.name, c.ok, detail) if c.name == "latent stats" else c for c in checks]
    return checks, summary | {"latent_stats": line}


def _own_folders_stats(output: Output, plan: Any, report: ValidationReport) -> ValidationReport:
    """A trainer's own folders (the LTX layout's records) that passed: the units' latent moments merged into
    ``.diffprep/latent_stats.pt`` as for shards, the report rewritten with what that adds."""
    from diffprep.report.latent_stats import finalized_stats

    if not report.ok:
        return report
    checks, summary, files = finalized_stats(output, plan)
    checks += _write_state(output, plan, files)
    return (_report(output, report.checks + checks, _with_units_stats(report.summary, summary)) if checks or summary
            else report)


def _write_state(output: Output, plan: Any, files: dict[str, bytes]) -> list[Check]:
    """Write what a passed validation adds to the state folder; per-channel statistics never replace a file with
    the covariance (``diffprep.report.latent_stats.kept_richer``), and the check says what was kept."""
    from diffprep.report.latent_stats import kept_richer

    checks = []
    for name, data in files.items():
        if name == contract.LATENT_STATS:
            data, kept = kept_richer(output, plan, data)
            if kept:
                checks.append(Check("latent stats with the covariance", True, kept))
        output.state.write_bytes(name, data)
    return checks


def _with_units_stats(summary: dict[str, Any], units: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with the units' statistics line (``latent_stats_full``, after ``--full-cov``) added, and its
    condition number also in ``latent_stats`` (beside the count, the mean and the std of validation's own pass),
    which the report shows."""
    joined = summary | units
    full = units.get("latent_stats_full")
    if full and "condition" in full:
        own = joined.get("latent_stats") or {"count": full["count"], "samples": full["samples"]}
        joined["latent_stats"] = own | {"condition": full["condition"]}
    return joined


def _encoding(name: str | None):
    return get_encoding(name) if name in contract.ENCODINGS else None


def _report(output: Output, checks: list[Check], summary: dict[str, Any]) -> ValidationReport:
    """The report, written to ``.diffprep/validation.json`` when the output exists."""
    ok = bool(checks) and all(check.ok for check in checks)
    report = ValidationReport(out_dir=output.uri, ok=ok, checks=checks, summary=summary)
    # Rendered here, in every validation: a run's own validation (which shows only its summary) then fails on a
    # report that `diffprep validate` could not print, instead of saying "passed" over it.
    report.to_markdown()
    if output.local.is_dir() and (not output.remote or output.exists()):
        output.state.write_json(contract.VALIDATION_JSON, report.to_json())
    return report


def _previews(output: Output, count: int) -> dict[str, Any]:
    """``count`` samples decoded next to their sources, with a contact sheet; a note when that cannot be done."""
    from diffprep.validation.decode import decode_dataset
    from diffprep.report.pictures import CONTACT_SHEET

    out = output.local
    try:
        # local_only: validation downloads nothing; a VAE that is not at hand means no previews.
        report = decode_dataset(out, count, sheet=out / contract.STATE_DIR / CONTACT_SHEET, local_only=True)
    except DiffprepError as error:  # its message says why in words (no VAE at hand, an encoding with no pictures)
        return {"note": f"no previews: {error}"}
    except Exception as error:  # noqa: BLE001 - previews inform; what stopped them is reported, never raised
        # A dataset without a reachable VAE (a copy elsewhere, a model not cached) is still valid, and a damaged
        # shard already fails the checks above.
        return {"note": f"no previews: {type(error).__name__}: {error}"}
    summary = report.to_json()
    del summary["images"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffprep.validation",
        description="Validate a finalized diffprep dataset; exit 0 when every check passes, 1 otherwise.",
    )
    parser.add_argument("out", help="the output folder (holds .nv-meta/), or s3://bucket/prefix")
    parser.add_argument(
        "--encoding", choices=contract.ENCODINGS, help="fail unless dataset.yaml declares this encoding"
    )
    parser.add_argument("--max-load", type=int, default=None, metavar="N", help="load at most N samples per split")
    parser.add_argument("--full", action="store_true",
                        help="load every sample (default: one drawn from each shard; every shard's headers, "
                             "count and digest are checked either way)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="with --full: load in N processes (a folder; the report is the same)")
    parser.add_argument("--previews", type=int, default=4, metavar="N",
                        help="decode N samples next to their sources into .diffprep/contact_sheet.png (0: none)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of Markdown")
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="for s3://: endpoint of a non-AWS store (default: AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--s3-profile", default=None, help="for s3://: AWS profile (default: AWS_PROFILE)")
    args = parser.parse_args(argv)
    options = {"encoding": args.encoding, "max_load": args.max_load, "previews": args.previews, "full": args.full,
               "workers": args.workers}
    try:
        out = OutputRef(location=dataset_root(str(args.out)), endpoint_url=args.s3_endpoint_url,
                        profile=args.s3_profile).open()
        refuse_links(out)  # its report and statistics go into the dataset's state folder
        if args.json:
            # Energon prints progress and errors on stdout; keep stdout for the JSON alone.
            with contextlib.redirect_stdout(sys.stderr):
                report = validate_dataset(out, **options)
            print(json.dumps(report.to_json(), indent=1))
        else:
            report = validate_dataset(out, **options)
            print(report.to_markdown())
    except (ConfigError, SourceError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


__all__ = ["Check", "ValidationReport", "main", "validate_dataset"]
