"""``diffprep ignore-list OUT``: every stored sample read back and judged; the broken ones as FastGen's ignore list.

FastGen's WebDataset loaders take ``ignore_index_paths``: JSON files ``{"<shard>.tar": [key, ...]}`` whose keys
they skip (a filter on ``__key__`` before decoding). Its deterministic loader subtracts each shard's listed keys
from ``shard_counts.json``, so that file keeps counting every sample: a resume then skips exactly the samples
the loader yields. This scan reads every shard at the output's top (local or a bucket prefix), every sample of
it, and judges each with the checks validation uses: its members against the encoding's fields (a missing
member), the encoding's cooker (an undecodable member: what the loader would fail on), the encoding's sample
inspector against the plan's ``expected`` shapes and dtype (a bad shape, dtype, NaN or Inf). Unlike validation
it goes on past a broken sample, and names each key with its reasons. It only reads the shards.

A shard that cannot be read to its end (cut short) has its unit manifest's keys after the break listed too: the
loader never yields them, and ``shard_counts.json`` counts them.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from diffprep import contract
from diffprep.report.checks import Findings
from diffprep.encodings import get_encoding
from diffprep.errors import ConfigError
from diffprep.writer.layouts import Layout
from diffprep.output import Output
from diffprep.run.manifests import Manifests
from diffprep.writer.shards import atomic_write_bytes
from diffprep.validation.dataset import normalize_expected

IGNORE_INDEX_JSON = contract.IGNORE_INDEX_JSON
Progress = Callable[[str, int, int], None]


@dataclass
class IgnoreScan:
    """What the scan found: shard -> key -> reasons, and how much it read."""

    shards: int = 0
    samples: int = 0
    broken: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def add(self, shard: str, key: str, reason: str) -> None:
        self.broken.setdefault(shard, {}).setdefault(key, []).append(reason)

    @property
    def found(self) -> int:
        return sum(len(keys) for keys in self.broken.values())

    def ignore_index(self) -> dict[str, list[str]]:
        """FastGen's ``ignore_index_paths`` file: shard basename -> its broken keys, sorted."""
        return {shard: sorted(keys) for shard, keys in sorted(self.broken.items())}

    def to_json(self) -> dict[str, Any]:
        return {"shards": self.shards, "samples": self.samples, "broken": self.found,
                "keys": {shard: dict(sorted(keys.items())) for shard, keys in sorted(self.broken.items())}}

    def to_markdown(self) -> str:
        lines = [f"# Ignore list: {self.found} broken of {self.samples} samples in {self.shards} shards", ""]
        if self.samples and self.found >= self.samples:
            lines += ["Every sample is broken: FastGen's deterministic resume would loop forever on the counts this "
                      "list leaves (all 0). Encode the dataset again.", ""]
        if self.broken:
            lines += ["| shard | key | reasons |", "|---|---|---|"]
            for shard, keys in sorted(self.broken.items()):
                lines += [f"| {shard} | {key} | {'; '.join(reasons)} |" for key, reasons in sorted(keys.items())]
        return "\n".join(lines) + "\n"


def scan_output(output: Output, progress: Progress | None = None) -> IgnoreScan:
    """Every sample of every ``.tar`` at the output's top judged (``IgnoreScan``); raises ConfigError when the
    output has no plan.json to judge its samples against."""
    plan = output.state.plan()
    if plan is None:
        raise ConfigError(f"{output.uri} has no {contract.STATE_DIR}/{contract.PLAN_JSON}: the scan judges samples "
                          "against the plan that wrote them; run it on a dataset diffprep wrote")
    encoding = get_encoding(plan.encoding)
    if encoding.own_folders(plan) is not None:
        raise ConfigError(f"{output.uri} is written in the trainer's own files, not shards: an ignore list is for "
                          "shard layouts (energon, fastgen); run `diffprep validate` on it")
    expected = normalize_expected(plan.expected, "plan.json") | {"source": "plan"} if plan.expected else None
    layout = Layout.of_plan(plan.settings)
    subflavors = {"encoding": plan.encoding, **layout.subflavors()}
    cooker = next((c for c in encoding.task_encoder().cookers if c.is_match(subflavors)), None)
    manifests = Manifests(output)  # one shard's keys at a time, not every key of the dataset
    shards = sorted(name for name in output.entries() if name.endswith(contract.SHARD_SUFFIX) and "/" not in name)
    scan = IgnoreScan(shards=len(shards))
    for done, shard in enumerate(shards, start=1):
        manifest = manifests.get(contract.unit_of_shard(shard))
        keys = manifest.keys if manifest is not None and manifest.shard == shard else None
        _scan_shard(output, shard, keys, encoding, expected, layout, subflavors, cooker, scan)
        if progress is not None:
            progress("shards", done, len(shards))
    return scan


def _scan_shard(output: Output, shard: str, manifest_keys: list[str] | None, encoding: Any,
                expected: dict[str, Any] | None, layout: Layout, subflavors: dict, cooker: Any,
                scan: IgnoreScan) -> None:
    """Each sample of ``shard`` (members grouped by key, as webdataset groups them) judged into ``scan``."""
    seen: list[str] = []

    def judge(key: str, members: dict[str, bytes]) -> None:
        seen.append(key)
        scan.samples += 1
        for reason in sample_problems(key, members, encoding, expected, layout, subflavors, cooker):
            scan.add(shard, key, reason)

    key, members = None, {}
    try:
        with output.open(shard) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name, _, extension = member.name.rpartition("/")[2].partition(".")
                if key is not None and name != key:
                    judge(key, members)
                    members = {}
                key = name
                members[extension] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as error:
        # The sample being read when the tar broke, and every one after it, never reaches the loader.
        reason = f"shard_unreadable: the tar breaks after {len(seen)} samples ({type(error).__name__}: {error})"
        lost = [k for k in (manifest_keys or []) if k not in set(seen)] or ([key] if key is not None else [])
        for lost_key in lost:
            scan.add(shard, lost_key, reason)
        return
    if key is not None:
        judge(key, members)


def sample_problems(key: str, members: dict[str, bytes], encoding: Any, expected: dict[str, Any] | None,
                    layout: Layout, subflavors: dict, cooker: Any) -> list[str]:
    """Why one stored sample is broken against its dataset's contract ([] when it is whole): the encoding's field
    check, its cooker, then a fresh inspector of validation's (its findings on this sample only)."""
    problem = encoding.field_problem(layout.fields_of(members), expected)
    if problem:
        return [f"missing_member: {problem} (members {sorted(members)})"]
    if cooker is None:
        return []
    crude = {"__key__": key, "__restore_key__": (), "__subflavors__": subflavors, "__sources__": (), **members}
    try:
        sample = cooker.cook(crude)
    except Exception as error:  # noqa: BLE001 - a sample the cooker cannot decode is the finding
        return [f"undecodable: {type(error).__name__}: {error}"]
    inspector = encoding.inspector(expected)
    try:
        inspector.inspect(sample)
    except Exception as error:  # noqa: BLE001 - a sample the inspector cannot judge is broken too
        return [f"undecodable: {type(error).__name__}: {error}"]
    found = [item for value in vars(inspector).values() if isinstance(value, Findings) for item in value.items]
    return [f"contract: {item}" for item in found]


def write_ignore_list(output: Output, scan: IgnoreScan, target: str | None = None) -> str:
    """The ignore list (``target``: a path or URL; default ``<out>/ignore_index.json``, beside the tars) and the
    report with every key's reasons (``.diffprep/ignore_report.json``); where the list went."""
    data = (json.dumps(scan.ignore_index(), indent=1, sort_keys=True) + "\n").encode("utf-8")
    output.state.write_json(contract.IGNORE_REPORT_JSON, scan.to_json())
    if target is None:
        output.write_file(IGNORE_INDEX_JSON, data)
        return f"{output.uri}/{IGNORE_INDEX_JSON}"
    if "://" in target:
        raise ConfigError(f"--output {target}: a local path; the default, {IGNORE_INDEX_JSON} beside the shards, "
                          "works for a bucket prefix too")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(target), data)
    return target


__all__ = ["IGNORE_INDEX_JSON", "IgnoreScan", "sample_problems", "scan_output", "write_ignore_list"]
