"""Phase 5, audit counts: every planned sample is in a shard or in the rejects, with a reason.

For every unit: inputs == written + rejected, the tar holds exactly the
manifest's keys, and the manifest's source ids plus its rejects are exactly
the unit's planned ids. Problems make the audit fail; rejects are surfaced
for approval. A reject retried in a later unit (its inputs changed) is
superseded: the id counts once, with its latest outcome.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from diffprep import contract
from diffprep.run.approvals import ABORT, Question
from diffprep.encodings import get_encoding, unit_files_layout
from diffprep.writer.layouts import Layout
from diffprep.run.long_videos import discarded_frames
from diffprep.output import Output, as_output
from diffprep.writer.plan import Plan
from diffprep.writer.shards import UnitManifest
from diffprep.run.manifests import Manifests, ShardFacts, output_shard_facts

REJECT_PREVIEW = 1000


@dataclass
class AuditReport:
    units: int
    inputs: int
    written: int
    rejected: int
    by_reason: dict[str, int]
    notes: dict[str, int]  # kept but counted: empty captions, truncated captions
    rejected_ids: list[dict]  # source id, reason, detail (first REJECT_PREVIEW)
    problems: list[str] = field(default_factory=list)
    missing_from_source: int = 0
    superseded: int = 0  # rejects retried in a later unit, counted there instead
    rejects_digest: str = ""  # sha256 of every counted reject's id and reason (an answer holds for these)
    # Long videos (--split-scenes): frames of the sources no clip takes, by why (short_shot, chain_tail...), from
    # the plan; no sample is missing for them, but the frames are named.
    discarded_frames: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rejected_fraction(self) -> float:
        return self.rejected / self.inputs if self.inputs else 0.0

    def to_json(self) -> dict:
        data = asdict(self) | {"ok": self.ok}
        for name in ("superseded", "rejects_digest", "discarded_frames"):  # audit.json as before without them
            if not data[name]:
                del data[name]
        return data

    def to_markdown(self) -> str:
        lines = [
            "| units | inputs | written | rejected |",
            "|---:|---:|---:|---:|",
            f"| {self.units} | {self.inputs} | {self.written} | {self.rejected} |",
        ]
        if self.by_reason:
            lines += ["", "| reject reason | samples |", "|---|---:|"]
            lines += [f"| `{reason}` | {n} |" for reason, n in sorted(self.by_reason.items())]
        if self.notes:
            lines += ["", "| kept, counted | samples |", "|---|---:|"]
            lines += [f"| `{name}` | {n} |" for name, n in sorted(self.notes.items())]
        if self.discarded_frames:
            lines += ["", "| source frames in no clip | frames |", "|---|---:|"]
            lines += [f"| `{reason}` | {n} |" for reason, n in sorted(self.discarded_frames.items())]
        if self.problems:
            lines += ["", "**Problems:**"] + [f"- {p}" for p in self.problems]
        return "\n".join(lines)


def rejects_accepted(report: AuditReport, accept: float | None) -> bool:
    """No rejects, or no more than the fraction accepted ahead of time."""
    return report.rejected == 0 or (accept is not None and report.rejected_fraction <= accept)


def rejects_question(report: AuditReport, out_dir: str | os.PathLike, advice: str = "") -> Question:
    """Whether to finalize without the rejected samples; ``advice``: the encoding's way to keep them."""
    shown = report.rejected_ids[:50]
    lines = [
        f"**{report.rejected} of {report.inputs} samples** ({report.rejected_fraction:.2%}) were rejected: "
        "the dataset would be smaller than its source.",
        "",
        report.to_markdown(),
        "",
        "| source id | reason | detail |",
        "|---|---|---|",
        *(f"| `{r['source_id']}` | `{r['reason']}` | {r['detail'].replace('|', '/')} |" for r in shown),
    ]
    if report.rejected > len(shown):
        lines.append(f"\n...and {report.rejected - len(shown)} more in "
                     f"`{out_dir}/{contract.STATE_DIR}/{contract.AUDIT_JSON}`")
    if advice:
        lines += ["", advice]
    lines += [
        "",
        "**Choices:** `accept`: finalize without them (the encoded shards are kept) · `abort`: stop here; "
        "fix the inputs and re-run (finished units are kept).",
    ]
    return Question(
        key="rejected-samples",
        title=f"{report.rejected} samples were rejected",
        description="\n".join(lines),
        choices=("accept", ABORT),
        preset_hint=f"--accept-rejects {report.rejected_fraction:.4f} (flow parameter output.accept_rejects)",
    )


def answered_before(output: Output, report: AuditReport) -> dict | None:
    """The answer recorded for exactly these rejects (``record_answer``), or None: they are to be asked about."""
    recorded = output.state.read_json(contract.REJECTS_ANSWER_JSON)
    if recorded and recorded.get("answer") == "accept" and recorded.get("rejects_digest") == report.rejects_digest:
        return recorded
    return None


def record_answer(output: Output, report: AuditReport, answer: str) -> None:
    """Keep the rejects question's answer for these rejects, so a re-run (a schedule without a terminal) does not
    ask it again; a different set of rejects has another digest and is asked about."""
    output.state.write_json(contract.REJECTS_ANSWER_JSON, {
        "answer": answer, "rejects_digest": report.rejects_digest, "rejected": report.rejected,
        "inputs": report.inputs, "by_reason": report.by_reason,
        "answered_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def audit(output: Output | str | os.PathLike, plan: Plan, *, units: list[int] | None = None,
          workers: int = 1) -> AuditReport:
    """Reconcile the plan, the manifests and the tars; write ``.diffprep/audit.json``.

    The manifests are read one at a time (``diffprep.run.manifests.Manifests``): nothing here holds more
    than one unit's ids besides the counts and the first ``REJECT_PREVIEW`` rejects. A shard whose size and
    sha256 are its manifest's is trusted to hold the manifest's keys (the writer committed both together);
    its tar headers are parsed only where they differ, to say what changed. ``workers`` > 1 reads and hashes
    the shards in that many threads. The tars are read where they are (a bucket prefix's from the bucket); the
    manifests from the output's state.
    """
    output = as_output(output)
    manifests = Manifests(output)
    required = get_encoding(plan.encoding).required_fields(plan.expected)
    fields = sorted(Layout.of_plan(plan.settings).member_names(required))  # the names the plan's layout writes
    wanted = [u for u in plan.units if units is None or u.unit in units]
    problems: list[str] = []
    by_reason: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    rejected_ids: list[dict] = []
    inputs = written = rejected = superseded = 0
    digest = hashlib.sha256()
    files_layout, audited = unit_files_layout(plan), []  # a layout whose units write files (LTX, GAE)
    encoding = get_encoding(plan.encoding)
    facts = _shard_facts_in_pool(output, manifests, wanted, workers) if files_layout is None else {}
    for unit in wanted:
        manifest = manifests.get(unit.unit)
        if manifest is None:
            inputs += unit.count
            problems.append(f"unit {unit.unit:06d} has no manifest (not encoded): re-run the encode")
            continue
        if manifest.fingerprint != plan.fingerprint:
            inputs += unit.count
            problems.append(f"unit {unit.unit:06d} was written with other settings "
                            f"(fingerprint {manifest.fingerprint})")
            continue
        planned = encoding.planned_ids(unit, manifest)  # an ingested file: the rows it held
        inputs += len(planned)
        accounted = list(manifest.source_ids) + [r.source_id for r in manifest.rejects]
        if sorted(accounted) != sorted(planned):
            lost = sorted(set(planned) - set(accounted))
            extra = sorted(set(accounted) - set(planned))
            problems.append(
                f"unit {unit.unit:06d}: {len(planned)} planned, {manifest.count} written + "
                f"{len(manifest.rejects)} rejected; unaccounted {lost[:5]}, unplanned {extra[:5]}"
            )
        if manifest.count != len(manifest.keys):
            problems.append(f"unit {unit.unit:06d}: manifest count {manifest.count} != {len(manifest.keys)} keys")
        if files_layout is not None:  # the trainer's own files instead of a shard
            problems += files_layout.audit_unit(output, manifest, plan)
            audited.append(manifest)
        elif not manifest.has_shard:  # every sample rejected: no shard, and none may claim samples
            if manifest.count:
                problems.append(f"unit {unit.unit:06d}: the manifest counts {manifest.count} samples but names no "
                                "shard")
        else:
            found = facts.get(manifest.shard) or output_shard_facts(output, manifest.shard, manifest.bytes,
                                                                     manifest.sha256)
            problems += _shard_problems(unit.unit, manifest, found, fields)
        written += manifest.count
        for reject in manifest.rejects:
            if plan.superseded(unit.unit, reject.source_id):
                superseded += 1
                continue
            rejected += 1
            digest.update(f"{reject.source_id}\t{reject.reason}\n".encode("utf-8", "surrogateescape"))
            by_reason[reject.reason] += 1
            if len(rejected_ids) < REJECT_PREVIEW:
                rejected_ids.append({"source_id": reject.source_id, "reason": reject.reason, "detail": reject.detail})
        notes.update(manifest.notes)
    if files_layout is not None and units is None:  # every folder as a whole: the written samples, nothing else
        problems += files_layout.audit_folders(output, plan, audited)
    report = AuditReport(
        units=len(wanted),
        inputs=inputs - superseded,
        written=written,
        rejected=rejected,
        by_reason=dict(sorted(by_reason.items())),
        notes=dict(sorted(notes.items())),
        rejected_ids=rejected_ids,
        problems=problems,
        missing_from_source=plan.missing_count,
        superseded=superseded,
        rejects_digest=digest.hexdigest() if rejected else "",
        discarded_frames=discarded_frames(plan.scenes),
    )
    output.state.write_json(contract.AUDIT_JSON, report.to_json())
    return report


def _shard_problems(unit: int, manifest: UnitManifest, found: ShardFacts, fields: list[str]) -> list[str]:
    """What is wrong with a committed unit's shard: missing, other bytes than committed, other keys or fields."""
    if found.size is None:
        return [f"unit {unit:06d}: shard {manifest.shard} is missing"]
    if found.trusted(manifest):
        return []
    problems = []
    if found.size != manifest.bytes:
        problems.append(f"unit {unit:06d}: shard {manifest.shard} is {found.size} bytes, its manifest records "
                        f"{manifest.bytes}: the shard changed after it was committed; re-encode that unit")
    else:
        problems.append(f"unit {unit:06d}: shard {manifest.shard} has sha256 {found.sha256[:12]}…, its manifest "
                        f"records {manifest.sha256[:12]}… (same size): the shard changed after it was committed; "
                        "re-encode that unit")
    if found.keys is None:
        return problems + [f"unit {unit:06d}: shard {manifest.shard} cannot be read: {found.error}"]
    if list(found.keys) != list(manifest.keys):
        problems.append(f"unit {unit:06d}: {manifest.shard} holds {len(found.keys)} samples, the manifest "
                        f"lists {len(manifest.keys)}")
    incomplete = [k for k, exts in found.keys.items() if sorted(exts) != fields]
    if incomplete:
        problems.append(f"unit {unit:06d}: samples with missing fields: {incomplete[:5]}")
    return problems


def _shard_facts_in_pool(output: Output, manifests: Manifests, wanted: list, workers: int) -> dict[str, ShardFacts]:
    """Shard -> its facts, read by ``workers`` threads ({} with one: audit reads each shard as it reaches its unit).

    Threads, not processes: what a trusted shard costs is reading and hashing its bytes, and both run outside
    the GIL (hashlib releases it for large blocks), without a process's start-up (seconds: it imports this
    package again). Holds one small record per shard, never a sample id.
    """
    if workers <= 1:
        return {}
    jobs = []  # (shard, size, sha256): one manifest read at a time
    for unit in wanted:
        manifest = manifests.get(unit.unit)
        if manifest is not None and manifest.has_shard:
            jobs.append((manifest.shard, manifest.bytes, manifest.sha256))
    if len(jobs) < 2:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="audit") as pool:
        found = pool.map(lambda job: output_shard_facts(output, *job), jobs)
        return {job[0]: facts for job, facts in zip(jobs, found)}
