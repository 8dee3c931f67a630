"""``--layout edm-zip``: a class-conditional dataset as the one ZIP that EDM's and EDM2's ``dataset_tool.py`` write
and FastGen's ``ImageFolderDataset`` (``CIFAR10_Loader_Config``, ``ImageNet64_Loader_Config`` ...) reads.

Units are written and committed as for any raw run (shards of ``png`` +
``meta.json`` + ``txt``, each committed by its manifest), so resume, workers and
the audit work per unit as always. Finalize assembles ``<out>/dataset.zip`` from
the committed shards, in unit order and each shard's manifest order:

- entries ``NNNNN/imgNNNNNNNN.png`` (``contract.edm_zip_name``): an 8-digit index
  counting 0, 1, 2 ... over the written samples (rejects leave no gap), the
  folder its first five digits; the PNG bytes are the shard's, written with
  compression level 0 and no metadata as EDM writes them;
- then ``dataset.json``: ``{"labels": [[name, label], ...]}`` in the same order,
  or ``{"labels": null}`` when a sample has no label (an unlabeled source);
- every entry stored (no compression), with a fixed timestamp and mode, so the
  same shards give the same archive bytes: a resumed run gives the same zip.

It is written to a temporary name beside it, fsynced and renamed. Validation
reads it the way FastGen's loader does (every name of the archive, the data
files picked by extension and sorted, one shape for all, ``dict(labels)`` holding
every data file, int labels >= 0, the label width ``max(label) + 1``) and checks
what the archive must be besides: only data files and ``dataset.json``, every
entry stored, the names contiguous, square power-of-two RGB PNGs, one per written
sample, and a label width equal to the source's number of classes where the
source knows it (a subset missing the last class would silently narrow it).
There is no Energon metadata. Flips are the loader's (``xflip``): never stored.

An archive of latents (the sd-vae posteriors) also gets its latent statistics:
the units' moments, saved as each unit wrote them (``diffprep.report.latent_stats``),
are merged at validation into ``.diffprep/latent_stats.pt`` as for any latent
dataset, after a check that they give the mean and std of the archive's own
data files (read once, in the same pass as the checks above).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.errors import ConfigError, DatasetValidationError
from diffprep.report.latent_stats import LATENT_READERS, LatentStats, latent_of
from diffprep.writer.layouts import Layout
from diffprep.writer.plan import Plan
from diffprep.writer.shards import fsync_dir, temp_name

PNG_COMPRESS_LEVEL = 0  # EDM's dataset_tool: "uncompressed PNG" (compress_level=0, optimize=False)
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a ZIP can record: the archive's bytes never depend on the clock
ZIP_MODE = 0o644


def is_edm_zip(plan: Plan | None) -> bool:
    return plan is not None and Layout.of_plan(plan.settings).name == contract.LAYOUT_EDM_ZIP


def check_settings(settings: Any, *, image_files: bool = True) -> None:
    """What an EDM archive is, refused before anything is planned: png (``image_files``), one square power-of-two
    size."""
    image, raw = settings.image, settings.raw
    if image_files and raw.image_format != "png":
        raise ConfigError(f"--layout edm-zip stores PNG files (EDM's dataset_tool); remove --image-format "
                          f"{raw.image_format}")
    if image.variable_size or image.buckets:
        raise ConfigError("--layout edm-zip holds one square size for every image (FastGen's loader asserts it): "
                          "remove --variable-size / --buckets")
    size = image.image_size
    if size & (size - 1):
        raise ConfigError(f"--layout edm-zip needs a power-of-two --image-size (EDM's dataset_tool requires it), "
                          f"got {size}: 32, 64, 128, 256, 512 ...")
    if settings.output.key_map:
        raise ConfigError("--layout edm-zip names its files itself (NNNNN/imgNNNNNNNN.png): remove --key-map")
    from diffprep.config.sections import CIFAR10_SIDE as CIFAR_SIZE

    if settings.source.type == "cifar10" and size != CIFAR_SIZE:
        raise ConfigError(f"CIFAR-10 is {CIFAR_SIZE} px and its archive stores it as it is (EDM's dataset_tool, "
                          f"FastGen's CIFAR10_Loader_Config): remove --image-size {size} or set it to {CIFAR_SIZE}")
    if settings.source.score_columns:
        raise ConfigError("--layout edm-zip stores images and labels only (FastGen's ImageFolderDataset reads no "
                          f"per-sample json): remove --score-column {','.join(settings.source.score_columns)}, or "
                          "use --layout fastgen")


def class_count(settings: Any) -> dict[str, int]:
    """What a plan records of ``--num-classes`` (only when set: other plans keep their fingerprint)."""
    count = settings.source.num_classes
    return {} if count is None else {"num_classes": count}


def planned_files(plan: Plan) -> list[str]:
    """What finalize writes at the output's top (the shards are the manifests')."""
    return [contract.EDM_ZIP]


# --- assembling ------------------------------------------------------------------------------------------------


# The data field of a unit's samples -> the archive's file name template.
DATA_FIELDS = {"png": contract.EDM_ZIP_IMAGE, contract.SD_VAE_POSTERIOR: contract.EDM_ZIP_LATENT}


def data_field(plan: Plan) -> str:
    return next(f for f in DATA_FIELDS if f in plan.expected.get("fields", ()))


def committed_samples(output: Any, plan: Plan) -> Iterator[tuple[str, bytes, dict[str, Any]]]:
    """(key, data file bytes, meta) of every committed sample, in unit order and each manifest's key order."""
    wanted = data_field(plan)
    manifests = [m for _, m in sorted(output.state.manifests().items()) if m.fingerprint == plan.fingerprint]
    for manifest in manifests:
        if not manifest.keys:
            continue
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(output.local / manifest.shard) as tar:
            for member in tar:
                key, _, field = member.name.partition(".")
                handle = tar.extractfile(member)
                if handle is not None:
                    members.setdefault(key, {})[field] = handle.read()
        for key in manifest.keys:
            fields = members.get(key, {})
            if wanted not in fields or contract.META not in fields:
                raise DatasetValidationError(f"{manifest.shard}: sample {key} has {sorted(fields)}, an edm-zip unit "
                                             f"holds {wanted} and {contract.META}; encode the unit again")
            yield key, fields[wanted], json.loads(fields[contract.META])


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # unix, whatever machine writes it
    info.external_attr = ZIP_MODE << 16
    return info


def write_archive(path: Path, entries: Iterator[tuple[str, bytes, int | None]]) -> tuple[int, str]:
    """(name, data, label) entries -> ``path`` through a temporary file, fsync and rename; (files, sha256)."""
    path = Path(path)
    tmp = path.with_name("." + temp_name(path.name))
    labels: list[list[Any]] = []
    unlabeled = False
    try:
        with open(tmp, "wb") as handle:
            with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for name, data, label in entries:
                    archive.writestr(_info(name), data)
                    unlabeled = unlabeled or label is None
                    labels.append([name, label])
                metadata = {"labels": None if unlabeled or not labels else labels}
                archive.writestr(_info(contract.EDM_ZIP_LABELS), json.dumps(metadata))
            handle.flush()
            os.fsync(handle.fileno())
        digest = hashlib.sha256()
        with open(tmp, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return len(labels), digest.hexdigest()


def finalize(output: Any, plan: Plan) -> Any:
    """``dataset.zip`` assembled from the committed units (the module docstring)."""
    from diffprep.run.energon import FinalizeResult

    target = output.local / contract.EDM_ZIP
    before = target.stat().st_size if target.is_file() else None

    template = DATA_FIELDS[data_field(plan)]

    def entries() -> Iterator[tuple[str, bytes, int | None]]:
        for index, (_, data, meta) in enumerate(committed_samples(output, plan)):
            yield contract.edm_zip_name(index, template), data, meta.get("label")

    count, sha256 = write_archive(target, entries())
    changed = before is None or before != target.stat().st_size
    return FinalizeResult(splits={}, counts={"train": count}, parts=[contract.EDM_ZIP], changed=changed)


# --- reading it back as FastGen does ---------------------------------------------------------------------------


def loader_view(path: Path) -> dict[str, Any]:
    """What FastGen's ``ImageFolderDataset`` makes of the archive: its data files (sorted), the raw shape
    [N, C, H, W] from the first, the labels (int64 [N] or None) and the label width."""
    Image.init()
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        supported = set(Image.EXTENSION) | {".npy"}
        files = sorted(n for n in names if os.path.splitext(n)[1].lower() in supported)
        if not files:
            raise DatasetValidationError(f"{path} holds no data file")
        first = _load(archive, files[0])
        labels = None
        if contract.EDM_ZIP_LABELS in names:
            listed = json.loads(archive.read(contract.EDM_ZIP_LABELS))["labels"]
            if listed is not None:
                by_name = dict(listed)
                labels = np.array([by_name[name] for name in files]).astype(np.int64)
    width = int(labels.max()) + 1 if labels is not None and labels.size else 0
    return {"files": files, "shape": [len(files), *first.shape], "labels": labels, "label_dim": width}


def _load(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    """One data file as the loader reads it: an ``.npy`` [C, H, W], an image HWC -> CHW."""
    with archive.open(name) as handle:
        if name.endswith(".npy"):
            array = np.load(handle)
            return array.reshape(-1, *array.shape[-2:])
        image = np.array(Image.open(handle))
    return image.reshape(*image.shape[:2], -1).transpose(2, 0, 1)


def check_archive(path: Path, plan: Plan, written: int | None, stats: Any = None
                  ) -> tuple[list[Check], dict[str, Any]]:
    """The archive read as FastGen reads it, and checked against what EDM's tool writes and the plan. ``stats`` (a
    ``LatentStats``), for an archive of latents: every good data file's latent is added to it in archive order."""
    if not path.is_file():
        return [Check("archive", False, f"{path} is missing: run finalize")], {}
    try:
        view = loader_view(path)
    except Exception as error:  # noqa: BLE001 - anything the loader would trip over is the finding
        return [Check("loads as FastGen's ImageFolderDataset", False, f"{type(error).__name__}: {error}")], {}
    files, labels = view["files"], view["labels"]
    entries = Findings("entries (names, order, stored)")
    latent = data_field(plan) == contract.SD_VAE_POSTERIOR
    template = contract.EDM_ZIP_LATENT if latent else contract.EDM_ZIP_IMAGE
    images = Findings("data files (one shape, square, power of two)")
    label_check = Findings("labels")
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        data_infos = [i for i in infos if i.filename != contract.EDM_ZIP_LABELS]
        expected = [contract.edm_zip_name(i, template) for i in range(len(data_infos))]
        if [i.filename for i in data_infos] != expected:
            entries.add(f"the data files are not {expected[:1]} ... {expected[-1:]} in order: "
                        f"{[i.filename for i in data_infos][:3]}")
        if [i.filename for i in infos].count(contract.EDM_ZIP_LABELS) != 1:
            entries.add(f"the archive must hold {contract.EDM_ZIP_LABELS} once")
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                entries.add(f"{info.filename} is compressed (method {info.compress_type}); EDM's archives are stored")
        shape = view["shape"][1:]
        side = shape[-1]
        channels = plan.expected["posterior"][0] if latent else 3
        if len(shape) != 3 or shape[0] != channels or shape[1] != side or side & (side - 1):
            images.add(f"{files[0]} has shape {shape}, expected [{channels}, S, S] with S a power of two")
        for name in files:
            with archive.open(name) as handle:
                if latent:
                    array = np.load(handle, allow_pickle=False)
                    if array.dtype != np.float32 or list(array.shape) != plan.expected["posterior"] \
                            or not np.isfinite(array).all():
                        images.add(f"{name} is {array.dtype} {list(array.shape)}, expected finite float32 "
                                   f"{plan.expected['posterior']}")
                    elif stats is not None:
                        stats.add(latent_of(data_field(plan), array, name))
                    continue
                with Image.open(handle) as image:
                    if image.format != "PNG" or image.mode != "RGB" or list(image.size) != [side, side]:
                        images.add(f"{name} is {image.format} {image.mode} {image.size}, expected PNG RGB "
                                   f"{side}x{side}")
    asked = (getattr(plan, "settings", None) or {}).get("num_classes")
    if labels is None and asked is not None:
        label_check.add(f"--num-classes is {asked} but dataset.json's labels are null: the loader sees width 0")
    if labels is not None:
        if (labels < 0).any():
            label_check.add("a label is negative")
        classes = asked if asked is not None else plan.source.get("classes")
        where = f"--num-classes is {asked}" if asked is not None else f"the source has {classes} classes"
        if classes is not None and view["label_dim"] != classes:
            label_check.add(f"the loader's label width max(label)+1 is {view['label_dim']}, {where}: a subset "
                            "missing the last classes changes the model's label input")
    count = Check("samples", written is None or len(files) == written,
                  f"{len(files)} data files" + ("" if written is None else f", {written} written"))
    checks = [count, entries.check(f"{len(files)} names {contract.edm_zip_name(0, template)}... in order + "
                                   "dataset.json, stored"),
              images.check(f"{len(files)} files of shape {shape}"),
              label_check.check("no labels (null)" if labels is None else f"{len(labels)} labels, width "
                                f"{view['label_dim']}")]
    summary = {"files": len(files), "resolution": shape[-1], "label_dim": view["label_dim"],
               "labeled": labels is not None}
    return checks, summary


def validate(output: Any, plan: Plan) -> Any:
    """The validation report of an edm-zip output (``.diffprep/validation.json``)."""
    from diffprep.report.validation import ValidationReport

    audit = output.state.read_json(contract.AUDIT_JSON)
    written = audit.get("written") if audit else None
    field = data_field(plan)
    seen = LatentStats() if field in LATENT_READERS else None
    checks, summary = check_archive(output.local / contract.EDM_ZIP, plan, written, seen)
    summary = {"encoding": plan.encoding, "layout": contract.LAYOUT_EDM_ZIP, "samples": written, **summary}
    if seen is not None and seen.samples and all(c.ok for c in checks):
        stats_checks, stats_summary = _archive_stats(output, plan, field, seen)
        checks += stats_checks
        summary |= stats_summary
    if audit:
        summary["rejects"] = {key: audit[key] for key in ("inputs", "rejected", "by_reason")}
    report = ValidationReport(out_dir=output.uri, ok=all(c.ok for c in checks), checks=checks, summary=summary)
    output.state.write_json(contract.VALIDATION_JSON, report.to_json())
    return report


def _archive_stats(output: Any, plan: Plan, field: str, seen: Any) -> tuple[list[Check], dict[str, Any]]:
    """The archive's own latent statistics (the summary's ``latent_stats``, as the validation report shows them),
    and the check that the units' merged moments, which validation then saves, are theirs. Nothing to check when
    no unit saved moments (units of an earlier diffprep: ``diffprep latent-stats OUT`` computes the file)."""
    from diffprep.report.latent_stats import fields_stats, merged_unit_stats, same_stats

    archive = fields_stats({field: seen})
    line = {"mean": [float(v) for v in archive["mean"]], "std": [float(v) for v in archive["std"]],
            "count": seen.count, "samples": seen.samples}
    summary = {"latent_stats": ({"of": archive["of"]} if "of" in archive else {}) | line}
    merged = merged_unit_stats(output, plan)
    if not merged:
        return [], summary
    if not same_stats(merged, archive):
        return [Check("latent stats of the archive", False, (
            f"the units' merged mean/std differ from those of the archive's {seen.samples} data files: a unit's "
            f"moments do not match its shard, or {contract.EDM_ZIP} is not the units'; run finalize again, or "
            "`diffprep latent-stats OUT` to recompute them from the shards"))], summary
    what = f"{archive['of']} of the " if "of" in archive else ""
    return [Check("latent stats of the archive", True, (
        f"the units' merged moments give the mean and std of the {what}archive's {seen.samples} data files"))], summary


__all__ = ["check_archive", "check_settings", "finalize", "is_edm_zip", "loader_view", "planned_files",
           "validate", "write_archive"]
