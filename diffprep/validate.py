"""Strict validation of a finalized dataset: ``python -m diffprep.validate OUT``.

Every check ends up in the report as a ``Check``; nothing is only logged. The
checks, in order:

- metadata: ``dataset.yaml``, ``split.yaml``, ``.info.json`` and
  ``index.sqlite`` exist and parse, the index holds as many samples as
  ``.info.json`` counts;
- splits: every shard of ``.info.json`` is in exactly one split, split.yaml
  agrees with ``.diffprep/splits.json``, no committed shard is left out;
- shard files: every shard and its ``.tar.idx`` exist, the index has one entry
  per sample;
- shard counts, manifests, fields: the tar headers hold the ``.info.json``
  count, the unit manifest's keys, size and sha256, and every field a sample
  needs;
- load per split: every sample (or ``max_load`` per split) loads through
  Energon's own loader with diffprep's cooker and errors re-raised, and each
  split yields exactly its ``.info.json`` count;
- shapes/dtypes against the expected ones, finite values; per-channel latent
  mean/std (float64) saved to ``.diffprep/latent_stats.pt`` when all passed.

The summary also holds the reject counts of ``.diffprep/audit.json`` and
previews: a few samples decoded (latents through the dataset's VAE, raw
images as stored) next to their re-read sources, their PSNR, and a contact
sheet at ``.diffprep/contact_sheet.png``. Previews inform, they never fail the
validation: without a reachable VAE or source they are skipped with a note.

The report is written to ``.diffprep/validation.json``. Tensors are only
ever loaded with ``torch.load(weights_only=True)`` (in the cooker): a shard
holding a pickle that would run code fails validation instead of running it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sqlite3
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from diffprep import contract
from diffprep.cooker import RAW_CAPTION, RAW_IMAGE_FIELDS, FluxPreencodedTaskEncoder, FluxRawTaskEncoder
from diffprep.energon import Progress, read_assignment, read_split_yaml
from diffprep.errors import ConfigError, DatasetValidationError, SourceError
from diffprep.outputs import Output, open_output
from diffprep.shards import UnitManifest, atomic_write_bytes, atomic_write_json, read_manifests

TENSOR_NAMES = tuple(contract.field_stem(name) for name in contract.TENSOR_FIELDS)
# plan.json's "expected": a shape per tensor (None for a free dimension), the dtype, and optionally
# "fields", the fields every sample must have (how a raw plan names its image and caption fields).
EXPECTED_KEYS = (*TENSOR_NAMES, "dtype", "fields")
MAX_PROBLEMS_SHOWN = 10
MAX_SHAPES_KEPT = 20
_IDX_ENTRY_BYTES = 8  # Energon's .tar.idx: one uint64 offset per sample plus the end offset


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class ValidationReport:
    out_dir: str
    ok: bool
    checks: list[Check]
    summary: dict[str, Any]

    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def raise_if_failed(self) -> None:
        if not self.ok:
            names = ", ".join(check.name for check in self.failed())
            raise DatasetValidationError(f"validation of {self.out_dir} failed ({names}):\n{self.to_markdown()}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self, pictures: bool = False) -> str:
        """The report as Markdown; ``pictures`` embeds the contact sheet (for a Prefect artifact, not a terminal)."""
        lines = [f"# Validation {'passed' if self.ok else 'FAILED'}: `{self.out_dir}`", ""]
        lines += ["| | check | detail |", "|---|---|---|"]
        for check in self.checks:
            detail = check.detail.replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| {'ok' if check.ok else '**FAIL**'} | {check.name} | {detail} |")
        s = self.summary
        lines += ["", "## Summary", "", "| | |", "|---|---|"]
        for key in ("encoding", "shards", "samples", "bytes", "bytes_per_sample", "max_load"):
            if key in s:
                lines.append(f"| {key} | {s[key]} |")
        for split, info in s.get("splits", {}).items():
            lines.append(f"| {split} | shards {info.get('shards')}, samples {info.get('samples')}, "
                         f"loaded {info.get('loaded', 0)} |")
        if "expected" in s:
            lines.append(f"| expected ({s['expected'].get('source')}) | "
                         f"{ {k: v for k, v in s['expected'].items() if k != 'source'} } |")
        for name, info in s.get("fields", {}).items():
            shapes = ", ".join(f"{shape} ×{count}" for shape, count in info["shapes"].items())
            lines.append(f"| {name} | {shapes}; {', '.join(info['dtypes'])} |")
        if "images" in s:
            lines.append(f"| images | {s['images']} |")
        if "latent_stats" in s:
            stats = s["latent_stats"]
            lines.append(f"| latent mean | {', '.join(f'{v:.4f}' for v in stats['mean'])} |")
            lines.append(f"| latent std | {', '.join(f'{v:.4f}' for v in stats['std'])} |")
        if "rejects" in s:
            rejects = s["rejects"]
            reasons = ", ".join(f"`{reason}` {n}" for reason, n in rejects["by_reason"].items())
            lines.append(f"| rejected | {rejects['rejected']} of {rejects['inputs']} inputs"
                         f"{': ' + reasons if reasons else ''} |")
        if s.get("foreign"):
            lines.append(f"| not in dataset | {', '.join(s['foreign'])} |")
        lines += _previews_markdown(s.get("previews"))
        sheet = (s.get("previews") or {}).get("contact_sheet")
        if pictures and sheet and Path(sheet).is_file():
            from diffprep.decode import markdown_image

            lines += ["", markdown_image(sheet)]
        return "\n".join(lines) + "\n"


def _previews_markdown(previews: dict[str, Any] | None) -> list[str]:
    if not previews:
        return []
    lines = ["", "## Previews", ""]
    if "note" in previews:
        return lines + [previews["note"]]
    lines += ["| sample | source | PSNR (dB) | |", "|---|---|---:|---|"]
    for sample in previews["samples"]:
        value = "" if sample["psnr_db"] is None else f"{sample['psnr_db']:.2f}"
        lines.append(f"| {sample['key']} | {sample['source_id'] or ''} | {value} | {sample['note']} |")
    lines += ["", f"Contact sheet (source left, decoded right): `{previews['contact_sheet']}`"]
    return lines


class _Problems:
    """Problems found by one check, turned into a single ``Check`` with the first few named."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def check(self, ok_detail: str) -> Check:
        if not self.items:
            return Check(self.name, True, ok_detail)
        shown = self.items[:MAX_PROBLEMS_SHOWN]
        more = len(self.items) - len(shown)
        detail = "\n".join(shown) + (f"\n… and {more} more" if more else "")
        return Check(self.name, False, detail)


def _shape_str(shape: tuple[int, ...] | list[int | None]) -> str:
    return "x".join("*" if dim is None else str(dim) for dim in shape)


def _shape_matches(shape: tuple[int, ...], want: list[int | None]) -> bool:
    return len(shape) == len(want) and all(w is None or w == s for w, s in zip(want, shape))


def _normalize_expected(expected: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(expected) - set(EXPECTED_KEYS) - {"source"})
    if unknown:
        raise ConfigError(
            f"unknown keys {unknown} in expected shapes from {where}; valid keys are {list(EXPECTED_KEYS)}"
        )
    dtype = expected.get("dtype")
    if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ConfigError(f"expected dtype {dtype!r} from {where} is not a torch dtype name (e.g. 'bfloat16')")
    fields = expected.get("fields")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise ConfigError(f"expected fields from {where} must be a list of field names, got {fields!r}")
    result: dict[str, Any] = {"dtype": dtype, "fields": fields}
    for name in TENSOR_NAMES:
        shape = expected.get(name)
        valid = isinstance(shape, (list, tuple)) and all(d is None or isinstance(d, int) for d in shape)
        if shape is not None and not valid:
            raise ConfigError(f"expected {name} from {where} must be a list of ints (None for any size), got {shape!r}")
        result[name] = None if shape is None else list(shape)
    if result["latents"] is None:
        result["latents"] = [None, None, None]
    return result


class _LatentStats:
    """Per-channel mean and variance over all latent values, merged per sample in float64 (Chan et al.)."""

    def __init__(self) -> None:
        self.count = 0
        self.samples = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, latents: torch.Tensor) -> None:
        values = latents.detach().to(torch.float64).reshape(latents.shape[0], -1)
        n = values.shape[1]
        mean = values.mean(dim=1)
        m2 = ((values - mean[:, None]) ** 2).sum(dim=1)
        if self.mean is None:
            self.count, self.mean, self.m2 = n, mean, m2
        else:
            total = self.count + n
            delta = mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
            self.count = total
        self.samples += 1

    def result(self) -> dict[str, torch.Tensor]:
        assert self.mean is not None and self.m2 is not None
        return {
            "mean": self.mean.clone(),
            "std": (self.m2 / self.count).sqrt(),  # population std over every latent value of the channel
            "count": torch.tensor(self.count, dtype=torch.int64),
            "samples": torch.tensor(self.samples, dtype=torch.int64),
        }


class _Validator:
    def __init__(
        self,
        output: Output,
        encoding: str | None,
        expected: dict[str, Any] | None,
        max_load: int | None,
        progress: Progress | None,
    ) -> None:
        self.output = output
        self.out = output.local  # a bucket prefix's staged state; its shards are read from the bucket
        self.encoding_arg = encoding
        self.encoding: str | None = None
        self.expected: dict[str, Any] | None = None
        if expected is not None:
            self.expected = _normalize_expected(expected, "the expected argument") | {"source": "argument"}
        self.max_load = max_load
        self.progress = progress
        self.checks: list[Check] = []
        self.summary: dict[str, Any] = {}
        self.info: dict[str, int] | None = None
        self.manifests: dict[int, UnitManifest] = {}
        self.split_of: dict[str, str] | None = None
        self.stats = _LatentStats()
        self.fields: dict[str, dict[str, dict[str, int]]] = {}
        self.images: dict[str, int] = {}
        self.shapes = _Problems("shapes and dtypes")
        self.finite = _Problems("finite values")
        self.decode = _Problems("images")

    # -- metadata -----------------------------------------------------------------------------
    def check_metadata(self) -> None:
        problems = _Problems("metadata")
        meta = self.out / contract.NV_META
        dataset_yaml = meta / contract.DATASET_YAML
        try:
            config = yaml.safe_load(dataset_yaml.read_text(encoding="utf-8"))
            if not isinstance(config, dict) or config.get("__class__") != "CrudeWebdataset":
                problems.add(f"{dataset_yaml} does not declare a CrudeWebdataset: {config!r}")
            else:
                subflavors = config.get("subflavors")
                encoding = subflavors.get("encoding") if isinstance(subflavors, dict) else None
                if encoding not in contract.ENCODINGS:
                    problems.add(f"{dataset_yaml} has subflavors.encoding {encoding!r}, "
                                 f"expected one of {list(contract.ENCODINGS)}")
                elif self.encoding_arg is not None and encoding != self.encoding_arg:
                    problems.add(f"{dataset_yaml} declares encoding {encoding!r}, "
                                 f"validation asked for {self.encoding_arg!r}")
                else:
                    self.encoding = encoding
        except (OSError, yaml.YAMLError) as error:
            problems.add(f"{dataset_yaml}: {error}; run finalize")

        info_json = meta / contract.INFO_JSON
        try:
            counts = json.loads(info_json.read_text(encoding="utf-8"))["shard_counts"]
            if not isinstance(counts, dict) or not all(isinstance(v, int) and v > 0 for v in counts.values()):
                problems.add(f"{info_json} shard_counts must map shard names to positive counts")
            else:
                self.info = counts
        except (OSError, ValueError, KeyError) as error:
            problems.add(f"{info_json}: {type(error).__name__}: {error}; run finalize")

        try:
            if not (meta / contract.SPLIT_YAML).is_file():
                raise FileNotFoundError(f"{meta / contract.SPLIT_YAML} is missing; run finalize")
            self.split_of = read_split_yaml(self.out)
            unknown = sorted(set(self.split_of.values()) - set(contract.SPLITS))
            if unknown:
                problems.add(f"{meta / contract.SPLIT_YAML} has splits {unknown}; "
                             f"diffprep writes only {list(contract.SPLITS)}")
            if "train" not in self.split_of.values():
                problems.add(f"{meta / contract.SPLIT_YAML} has no train shards")
        except (OSError, yaml.YAMLError, DatasetValidationError) as error:
            problems.add(str(error))
            self.split_of = None

        index = meta / contract.INDEX_SQLITE
        if not index.is_file():
            problems.add(f"{index} is missing; run finalize")
        else:
            try:
                with contextlib.closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
                    indexed = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
                if self.info is not None and indexed != sum(self.info.values()):
                    total = sum(self.info.values())
                    problems.add(f"{index} holds {indexed} samples, {contract.INFO_JSON} counts {total}; "
                                 "run finalize again")
            except sqlite3.Error as error:
                problems.add(f"{index}: {error}")

        try:
            self.manifests = read_manifests(self.out)
        except (OSError, ValueError, TypeError, KeyError) as error:
            problems.add(f"cannot read the unit manifests in {contract.STATE_DIR}/{contract.UNITS_DIR}: "
                         f"{type(error).__name__}: {error}")

        if self.expected is None:
            plan = self.out / contract.STATE_DIR / contract.PLAN_JSON
            if plan.is_file():
                try:
                    planned = json.loads(plan.read_text(encoding="utf-8"))
                    planned = planned.get("expected") if isinstance(planned, dict) else None
                    if planned:
                        self.expected = _normalize_expected(planned, str(plan)) | {"source": "plan"}
                except (ValueError, ConfigError) as error:
                    problems.add(f"{plan}: {error}")
        self.summary["encoding"] = self.encoding
        self.checks.append(problems.check("dataset.yaml, split.yaml, .info.json, index.sqlite present and consistent"))

    # -- splits -------------------------------------------------------------------------------
    def check_splits(self) -> None:
        if self.info is None or self.split_of is None:
            return
        problems = _Problems("splits")
        for name in sorted(set(self.split_of) - set(self.info)):
            problems.add(f"{name} is in split {self.split_of[name]!r} but not in {contract.INFO_JSON}")
        for name in sorted(set(self.info) - set(self.split_of)):
            problems.add(f"{name} is in {contract.INFO_JSON} but in no split")
        recorded_path = self.out / contract.STATE_DIR / contract.SPLITS_JSON
        if recorded_path.is_file():
            try:
                recorded = read_assignment(self.out)
            except (OSError, ValueError, KeyError, TypeError) as error:
                problems.add(f"{recorded_path}: {type(error).__name__}: {error}")
                recorded = {}
            moved = {n: (recorded[n], s) for n, s in self.split_of.items() if n in recorded and recorded[n] != s}
            for name, (was, now) in sorted(moved.items()):
                problems.add(f"{name} is in {now!r} in split.yaml but recorded in {was!r} in {recorded_path}; "
                             "finalize again (do not run energon prepare by hand)")
        for manifest in self.manifests.values():
            if manifest.count and manifest.shard not in self.info:
                problems.add(f"{manifest.shard} is committed but not in the dataset; run finalize")
        self.summary["splits"] = {
            split: {
                "shards": sum(1 for s in self.split_of.values() if s == split),
                "samples": sum(self.info.get(n, 0) for n, s in self.split_of.items() if s == split),
            }
            for split in contract.SPLITS
            if split in self.split_of.values()
        }
        self.checks.append(problems.check(
            "shards per split: " + ", ".join(f"{split} {v['shards']}" for split, v in self.summary["splits"].items())
        ))

    # -- shards -------------------------------------------------------------------------------
    def check_shards(self) -> None:
        if self.info is None:
            return
        files = _Problems("shard files")
        counts = _Problems("shard counts")
        manifests_check = _Problems("manifests")
        fields = _Problems("fields")
        manifests = self.manifests
        total_bytes = 0
        names = sorted(self.info)
        for done, name in enumerate(names, start=1):
            size = self.output.size(name)
            if size is not None:
                total_bytes += size
                self._check_shard(name, manifests, files, counts, manifests_check, fields)
            else:
                files.add(f"{name} is listed in {contract.INFO_JSON} but missing")
            if self.progress is not None:
                self.progress("shards", done, len(names))
        samples_total = sum(self.info.values())
        self.summary.update(
            shards=len(names),
            samples=samples_total,
            bytes=total_bytes,
            bytes_per_sample=round(total_bytes / samples_total) if samples_total else 0,
        )
        self.checks.append(files.check(f"{len(names)} shards and their .tar.idx present"))
        self.checks.append(counts.check(f"tar headers match {contract.INFO_JSON} ({samples_total} samples)"))
        self.checks.append(manifests_check.check(
            "keys, size and sha256 match the unit manifests"
            if manifests
            else "no unit manifests (not written by diffprep)"
        ))
        self.checks.append(fields.check("every sample has its required fields"))

    def _check_shard(
        self,
        name: str,
        manifests: dict[int, UnitManifest],
        files: _Problems,
        counts: _Problems,
        manifests_check: _Problems,
        fields: _Problems,
    ) -> None:
        count = self.info[name]
        idx = name.removesuffix(contract.SHARD_SUFFIX) + contract.INDEX_SUFFIX
        idx_size = self.output.size(idx)
        if idx_size is None:
            files.add(f"{idx} is missing; run finalize to rebuild the tar index")
        elif idx_size != (count + 1) * _IDX_ENTRY_BYTES:
            files.add(f"{idx} indexes {idx_size // _IDX_ENTRY_BYTES - 1} samples, "
                      f"{contract.INFO_JSON} counts {count}; run finalize")

        try:  # one read of the shard (from the bucket, for a bucket prefix): size, hash and tar headers
            digest = self.output.shard_digest(name)
        except OSError as error:
            files.add(f"{name} cannot be read: {error}")
            return
        size, sha256, samples = digest.size, digest.sha256, digest.keys

        unit = contract.unit_of_shard(name)
        manifest = manifests.get(unit) if unit is not None else None
        if manifests and manifest is None:
            manifests_check.add(f"{name} has no unit manifest")
        if manifest is not None:
            if manifest.shard != name:
                manifests_check.add(f"manifest of unit {unit} names shard {manifest.shard}, not {name}")
            if (size, sha256) != (manifest.bytes, manifest.sha256):
                manifests_check.add(f"{name} is {size} bytes with sha256 {sha256[:12]}…, its manifest records "
                                    f"{manifest.bytes} bytes, {manifest.sha256[:12]}…: the shard was modified or "
                                    "corrupted after it was written; re-encode that unit")
        if digest.error is not None:
            counts.add(f"{name}: cannot read the tar headers ({digest.error})")
            return

        if len(samples) != count:
            counts.add(f"{name} holds {len(samples)} samples, {contract.INFO_JSON} counts {count}")
        if manifest is not None and sorted(manifest.keys) != sorted(samples):
            missing = sorted(set(manifest.keys) - set(samples))
            extra = sorted(set(samples) - set(manifest.keys))
            manifests_check.add(f"{name} holds {len(samples)} samples, its manifest records {manifest.count}: "
                                f"missing {missing[:5]}, extra {extra[:5]}")
        for key, exts in samples.items():
            problem = self._missing_fields(exts)
            if problem:
                fields.add(f"{name} sample {key}: {problem}")

    def _missing_fields(self, exts: list[str]) -> str:
        if len(set(exts)) != len(exts):
            return f"duplicate fields {sorted(exts)}"
        required = (self.expected or {}).get("fields") or []
        if any(f not in exts for f in required):
            return f"missing {[f for f in required if f not in exts]} (required by the plan)"
        if self.encoding == contract.ENCODING_RAW:
            images = [ext for ext in exts if ext in RAW_IMAGE_FIELDS]
            if len(images) != 1 or RAW_CAPTION not in exts:
                return f"needs one image field of {list(RAW_IMAGE_FIELDS)} and {RAW_CAPTION!r}, has {sorted(exts)}"
            return ""
        if self.encoding == contract.ENCODING_PREENCODED:
            missing = [f for f in contract.PREENCODED_FIELDS if f not in exts]
            return f"missing {missing}" if missing else ""
        return ""

    # -- loading ------------------------------------------------------------------------------
    def check_loading(self) -> None:
        if self.info is None or self.split_of is None or self.encoding is None:
            return
        from megatron.energon import WorkerConfig, get_loader, get_val_dataset
        from megatron.energon.errors import reraise_exception

        for split in self.summary.get("splits", {}):
            problems = _Problems(f"load {split}")
            total = self.summary["splits"][split]["samples"]
            limit = total if self.max_load is None else min(total, self.max_load)
            loaded = 0
            preencoded = self.encoding == contract.ENCODING_PREENCODED
            task_encoder = FluxPreencodedTaskEncoder() if preencoded else FluxRawTaskEncoder()
            worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
            try:
                with warnings.catch_warnings(), self.output.energon_access() as path:
                    # The loader asks for pinned memory, which a CPU-only machine cannot give; harmless here.
                    warnings.filterwarnings("ignore", message=".*pin_memory.*")
                    # get_val_dataset reads each split once, in order, without shuffling or repeating.
                    dataset = get_val_dataset(
                        path,
                        split_part=split,
                        batch_size=None,
                        worker_config=worker_config,
                        task_encoder=task_encoder,
                    )
                    for sample in get_loader(dataset, watchdog_timeout_seconds=None):
                        loaded += 1
                        self._inspect(sample)
                        if self.progress is not None and (loaded % 100 == 0 or loaded == limit):
                            self.progress(f"load {split}", loaded, limit)
                        if loaded >= limit and self.max_load is not None:
                            break
            except Exception as error:
                problems.add(f"loading failed after {loaded} samples: {type(error).__name__}: {error}")
            else:
                if loaded != limit:
                    problems.add(f"Energon yielded {loaded} samples, {contract.INFO_JSON} counts {total}")
            self.summary["splits"][split]["loaded"] = loaded
            limited = f" (max_load {self.max_load})" if limit < total else ""
            self.checks.append(problems.check(f"{loaded} of {total} samples loaded through Energon{limited}"))
        if self.encoding == contract.ENCODING_PREENCODED:
            self.checks.append(self.shapes.check(
                f"as expected ({self.expected.get('source')})" if self.expected else "no samples loaded"
            ))
            self.checks.append(self.finite.check("no NaN or Inf"))
            self.summary["fields"] = self.fields
            if self.expected:
                self.summary["expected"] = self.expected
        else:
            self.checks.append(self.decode.check("every image decodes"))
            self.summary["images"] = self.images

    def _inspect(self, sample: Any) -> None:
        if self.encoding == contract.ENCODING_RAW:
            self._inspect_raw(sample)
            return
        tensors = {name: getattr(sample, name) for name in TENSOR_NAMES}
        if self.expected is None:
            self.expected = {
                # Height and width stay free: without a plan, a variable-size dataset is as valid as a fixed one.
                "latents": [tensors["latents"].shape[0] if tensors["latents"].ndim == 3 else None, None, None],
                "prompt_embeds": list(tensors["prompt_embeds"].shape),
                "pooled_prompt_embeds": list(tensors["pooled_prompt_embeds"].shape),
                "dtype": str(tensors["latents"].dtype).removeprefix("torch."),
                "source": f"first sample {sample.__key__}",
            }
        for name, tensor in tensors.items():
            shape, dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
            seen = self.fields.setdefault(name, {"shapes": {}, "dtypes": {}})
            shape_key = _shape_str(shape)
            if shape_key in seen["shapes"] or len(seen["shapes"]) < MAX_SHAPES_KEPT:
                seen["shapes"][shape_key] = seen["shapes"].get(shape_key, 0) + 1
            seen["dtypes"][dtype] = seen["dtypes"].get(dtype, 0) + 1
            want = self.expected.get(name)
            if want is not None and not _shape_matches(shape, want):
                self.shapes.add(f"{sample.__key__} {name} has shape {_shape_str(shape)}, expected {_shape_str(want)}")
            if self.expected.get("dtype") and dtype != self.expected["dtype"]:
                self.shapes.add(f"{sample.__key__} {name} has dtype {dtype}, expected {self.expected['dtype']}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                self.finite.add(f"{sample.__key__} {name} has {bad} NaN/Inf values")
        latents = tensors["latents"]
        if latents.ndim == 3 and (self.stats.mean is None or self.stats.mean.shape[0] == latents.shape[0]):
            self.stats.add(latents)

    def _inspect_raw(self, sample: Any) -> None:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(sample.image)) as image:
                image.load()
                kind = f"{image.format} {image.mode}"
        except Exception as error:
            self.decode.add(f"{sample.__key__} {sample.image_format} does not decode: {type(error).__name__}: {error}")
            return
        self.images[kind] = self.images.get(kind, 0) + 1

    # -- results ------------------------------------------------------------------------------
    def report(self) -> ValidationReport:
        ok = bool(self.checks) and all(check.ok for check in self.checks)
        state = self.out / contract.STATE_DIR
        if ok and self.encoding == contract.ENCODING_PREENCODED and self.stats.samples:
            stats = self.stats.result()
            state.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(stats, buffer)
            atomic_write_bytes(state / contract.LATENT_STATS, buffer.getvalue())
            self.output.push(f"{contract.STATE_DIR}/{contract.LATENT_STATS}")
            self.summary["latent_stats"] = {
                "mean": [float(v) for v in stats["mean"]],
                "std": [float(v) for v in stats["std"]],
                "samples": self.stats.samples,
            }
            self.checks.append(Check(
                "latent stats", True,
                f"per-channel mean/std over {self.stats.samples} samples saved to "
                f"{contract.STATE_DIR}/{contract.LATENT_STATS}",
            ))
        report = ValidationReport(out_dir=self.output.uri, ok=ok, checks=self.checks, summary=self.summary)
        if self.out.is_dir():
            state.mkdir(parents=True, exist_ok=True)
            atomic_write_json(state / contract.VALIDATION_JSON, report.to_json())
            if self.output.remote and self.output.exists():
                self.output.push(f"{contract.STATE_DIR}/{contract.VALIDATION_JSON}")
        return report


def validate_dataset(
    out_dir: str | os.PathLike | Output,
    *,
    encoding: str | None = None,
    expected: dict[str, Any] | None = None,
    max_load: int | None = None,
    progress: Progress | None = None,
    previews: int = 4,
) -> ValidationReport:
    """Check a finalized output folder; never raises for a problem in the data, reports it.

    ``encoding`` defaults to the one in dataset.yaml (a different value fails).
    ``expected`` (keys ``latents``, ``prompt_embeds``, ``pooled_prompt_embeds``:
    shapes with None for a free dimension, or None for any latent size;
    ``dtype``: e.g. ``"bfloat16"``) defaults to ``plan.json``'s ``expected``,
    else to the first sample's shapes (latent height and width free).
    ``max_load`` limits the samples loaded per split; counts are still checked
    from the tar headers. ``progress(stage, done, total)`` is called as work
    advances. ``previews`` samples are decoded and compared with their
    sources into ``.diffprep/contact_sheet.png`` (0: none). Raises
    ConfigError only for invalid arguments.

    ``out_dir`` may be an ``s3://bucket/prefix`` (or an ``Output``): the
    dataset is then validated in place, its shards read back from the bucket
    and loaded through Energon's Multi-Storage Client access.
    """
    if encoding is not None and encoding not in contract.ENCODINGS:
        raise ConfigError(f"encoding must be one of {list(contract.ENCODINGS)}, got {encoding!r}")
    if max_load is not None and max_load < 1:
        raise ConfigError(f"max_load must be >= 1 (or None for every sample), got {max_load}")
    if previews < 0:
        raise ConfigError(f"previews must be >= 0 (0: none), got {previews}")
    output = open_output(out_dir)
    out = output.local
    validator = _Validator(output, encoding, expected, max_load, progress)
    if output.remote:
        if not output.exists():
            validator.checks.append(Check("metadata", False, f"{output.uri} holds no objects"))
            return validator.report()
        output.pull_state()
    elif not out.is_dir():
        validator.checks.append(Check("metadata", False, f"{out} is not a directory"))
        return validator.report()
    if max_load is not None:
        validator.summary["max_load"] = max_load
    validator.check_metadata()
    validator.check_splits()
    validator.check_shards()
    validator.check_loading()
    ours = set(validator.info or {}) | {m.shard for m in validator.manifests.values()}
    foreign = sorted(name for name in output.entries() if name.endswith((".tar", ".tgz")) and name not in ours)
    if foreign:
        validator.summary["foreign"] = foreign
    audit = out / contract.STATE_DIR / contract.AUDIT_JSON
    if audit.is_file():
        recorded = json.loads(audit.read_text(encoding="utf-8"))
        validator.summary["rejects"] = {key: recorded[key] for key in ("inputs", "rejected", "by_reason")}
    if previews and validator.manifests:
        validator.summary["previews"] = (
            {"note": "no previews for a bucket prefix: decode a few samples with `diffprep decode` on a copy"}
            if output.remote else _previews(out, previews))
    return validator.report()


def _previews(out: Path, count: int) -> dict[str, Any]:
    """``count`` samples decoded next to their sources, with a contact sheet; a note when that cannot be done."""
    from diffprep.decode import CONTACT_SHEET, decode_dataset

    try:
        # local_only: validation downloads nothing; a VAE that is not at hand means no previews.
        report = decode_dataset(out, count, sheet=out / contract.STATE_DIR / CONTACT_SHEET, local_only=True)
    except Exception as error:  # noqa: BLE001 - previews inform; what stopped them is reported, never raised
        # A dataset without a reachable VAE (a copy elsewhere, a model not cached) is still valid, and a damaged
        # shard already fails the checks above.
        return {"note": f"no previews: {type(error).__name__}: {error}"}
    summary = report.to_json()
    del summary["images"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffprep.validate",
        description="Validate a finalized diffprep dataset; exit 0 when every check passes, 1 otherwise.",
    )
    parser.add_argument("out", help="the output folder (holds .nv-meta/), or s3://bucket/prefix")
    parser.add_argument(
        "--encoding", choices=contract.ENCODINGS, help="fail unless dataset.yaml declares this encoding"
    )
    parser.add_argument("--max-load", type=int, default=None, metavar="N", help="load at most N samples per split")
    parser.add_argument("--previews", type=int, default=4, metavar="N",
                        help="decode N samples next to their sources into .diffprep/contact_sheet.png (0: none)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of Markdown")
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="for s3://: endpoint of a non-AWS store (default: AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--s3-profile", default=None, help="for s3://: AWS profile (default: AWS_PROFILE)")
    args = parser.parse_args(argv)
    options = {"encoding": args.encoding, "max_load": args.max_load, "previews": args.previews}
    try:
        out = open_output(args.out, endpoint_url=args.s3_endpoint_url, profile=args.s3_profile)
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


if __name__ == "__main__":
    sys.exit(main())
