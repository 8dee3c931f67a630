"""``diffprep verify-t2i ROOT…``: what GAE's text-to-image loader would find under its roots, and whether it reads.

Per split (``contract.T2I_SPLIT_FOLDERS``), as GAE's ``src/data/blip3o_wds.py``
resolves it: the roots are searched in order and the first whose
``<root>/<split folder>/*.tar`` (not recursive) has shards wins; for ImageNet
only shards with ``<shard>.done`` beside them count. Then, what GAE's own
``prepare_t2i_data.py verify`` does not check: every winning shard opens as a
tar, every sample has an image member (``jpg png jpeg webp``) that decodes and
a caption (``txt``, or ``json`` with ``long``/``short`` or ``captions``), and
ImageNet shards the loader would skip for a missing ``.done`` are named.
Anything missing, skipped or unreadable fails the split (exit 1).
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from diffprep import contract

SHOWN = 10  # problems named per split; the rest are counted


@dataclass
class SplitReport:
    split: str
    folder: str
    root: str | None = None  # the root the loader would read this split from
    shards: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.shards > 0 and not self.problems


def loader_shards(roots: list[str], split: str) -> tuple[str | None, list[Path], list[Path]]:
    """(winning root, the shards the loader reads there, the tars it skips there for a missing ``.done``)."""
    folder = contract.T2I_SPLIT_FOLDERS[split]
    for root in roots:
        tars = sorted((Path(root) / folder).glob("*" + contract.SHARD_SUFFIX))
        if split in contract.T2I_DONE_SPLITS:
            read = [tar for tar in tars if Path(contract.t2i_done_name(str(tar))).is_file()]
            skipped = [tar for tar in tars if tar not in read]
        else:
            read, skipped = tars, []
        if read:
            return root, read, skipped
    return None, [], []


def _caption(fields: dict[str, bytes]) -> str:
    if contract.T2I_CAPTION_JSON in fields:
        value = json.loads(fields[contract.T2I_CAPTION_JSON])
        if isinstance(value, dict):
            captions = value.get("captions")
            if isinstance(captions, list):
                return next((str(c).strip() for c in captions if c and str(c).strip()), "")
            return (value.get("long") or value.get("short") or "").strip()
    return fields.get(contract.T2I_CAPTION, b"").decode("utf-8").strip()


def check_shard(path: Path) -> tuple[int, list[str]]:
    """(samples, problems) of one shard: each sample needs a decodable image member and a non-empty caption."""
    samples: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile():
                    key, _, ext = member.name.rpartition("/")[2].partition(".")
                    samples.setdefault(key, {})[ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as error:
        return 0, [f"{path.name} does not read as a tar: {type(error).__name__}: {error}"]
    problems = []
    for key, fields in samples.items():
        image = next((fields[ext] for ext in contract.T2I_IMAGE_MEMBERS if ext in fields), None)
        if image is None:
            problems.append(f"{path.name} {key}: no image member ({'/'.join(contract.T2I_IMAGE_MEMBERS)})")
            continue
        try:
            with Image.open(io.BytesIO(image)) as opened:
                opened.load()
        except Exception as error:  # noqa: BLE001 - any undecodable image is a finding
            problems.append(f"{path.name} {key}: the image does not decode: {type(error).__name__}: {error}")
            continue
        try:
            caption = _caption(fields)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            caption, detail = "", f": {error}"
        else:
            detail = ""
        if not caption:
            problems.append(f"{path.name} {key}: no caption{detail}")
    if not samples:
        problems.append(f"{path.name} holds no sample")
    return len(samples), problems


def verify_split(roots: list[str], split: str) -> SplitReport:
    report = SplitReport(split, contract.T2I_SPLIT_FOLDERS[split])
    root, shards, skipped = loader_shards(roots, split)
    report.root, report.shards = root, len(shards)
    if root is None:
        unmarked = sum(len(loader_shards_unfiltered(r, split)) for r in roots)
        why = f" ({unmarked} tar(s) without {contract.T2I_DONE_SUFFIX})" if unmarked else ""
        report.problems.append(f"no shard the loader reads under any root{why}")
        return report
    for tar in skipped:
        report.problems.append(f"{tar.name} has no {tar.name}{contract.T2I_DONE_SUFFIX}: the loader skips it")
    for shard in shards:
        count, problems = check_shard(shard)
        report.samples += count
        report.problems.extend(problems)
    return report


def loader_shards_unfiltered(root: str, split: str) -> list[Path]:
    return sorted((Path(root) / contract.T2I_SPLIT_FOLDERS[split]).glob("*" + contract.SHARD_SUFFIX))


def present_splits(roots: list[str]) -> list[str]:
    """The known splits whose folder exists under some root (the default of ``verify-t2i``)."""
    return [split for split, folder in contract.T2I_SPLIT_FOLDERS.items()
            if any((Path(root) / folder).is_dir() for root in roots)]


def verify_roots(roots: list[str], splits: list[str] | None = None) -> list[SplitReport]:
    return [verify_split(roots, split) for split in (splits or present_splits(roots))]


def format_reports(reports: list[SplitReport]) -> str:
    if not reports:
        return "no T2I split folder under these roots (expected one of " \
               f"{sorted(contract.T2I_SPLIT_FOLDERS.values())})"
    lines = []
    for report in reports:
        status = "OK" if report.ok else "FAILED"
        lines.append(f"{report.split:10s} {status}: {report.shards} shard(s), {report.samples} sample(s) in "
                     f"{report.root or '-'}/{report.folder}")
        lines.extend(f"  - {problem}" for problem in report.problems[:SHOWN])
        if len(report.problems) > SHOWN:
            lines.append(f"  … and {len(report.problems) - SHOWN} more")
    return "\n".join(lines)
