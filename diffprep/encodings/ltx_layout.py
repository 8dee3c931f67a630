"""``--layout ltx``: an LTX-2 run written as the LTX-2 trainer's ``.precomputed/`` folders, with diffprep's safety.

The output's root is ``<output_dir>/.precomputed`` (the folder the trainer's
``preprocessed_data_root`` points at): ``latents/``, ``conditions/``,
``audio_latents/`` (runs with audio) and ``reference_latents/`` (IC-LoRA runs);
an audio-only run (T2A) writes ``conditions/`` and ``audio_latents/`` only,
``conditions/`` being the primary folder the trainer globs when there is no ``latents/``;
one ``torch.save``d dict per sample in each, named after the sample's media path
relative to the metadata file with the suffix ``.pt`` (a long video's clip, ``--split-scenes``: the media path's
stem with ``-shot<k>-<first>-<last>``, as ``window_relative_path`` writes it)
(reference/consumer-formats.md A1; the records are ``families/ltx2_precomputed``).
Its ``.diffprep/`` state sits inside it, so everything else holds as for shards:

- a unit writes its samples' files atomically (each to a temporary name, then
  renamed) and its manifest last, listing every file and its size: the manifest
  is the commit point; a unit that fails removes the files it wrote;
- a name belongs to the first sample of the plan that gives it; a later one (a
  row repeating a path, or ``a.mp4`` after ``a.mov``) is a ``duplicate_media_path``
  reject, where the trainer's tool would silently keep only the last;
- verify-existing loads one sample of every folder and checks its keys, dtypes and
  shapes against the plan, and a new directory is ``.precomputed-v2``;
- the audit checks each unit's files and that every required folder holds exactly
  one ``.pt`` per written sample, under the same relative paths, and nothing else;
- validation reads the folders as the trainer's ``PrecomputedDataset`` does (glob
  ``latents/**/*.pt``, the same relative path in every source,
  ``torch.load(weights_only=True)``) and checks every record against A1.
There is no Energon metadata to finalize.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.encodings.unit_files import UnitFilesWriter, save_report
from diffprep.writer.plan import Plan, dtype_name, shape_matches
from diffprep.errors import LinkInOutputError
from diffprep.families.ltx2_precomputed import load_record, sample_names
from diffprep.writer.links import link_message
from diffprep.writer.shards import Reject, UnitManifest, torch_bytes

UNIT_FILES = True  # its units write files, not shards (diffprep.encodings.unit_files_layout)


def precomputed_root(output_dir: str) -> str:
    """``<output_dir>/.precomputed``; a path already naming a ``.precomputed`` folder (or ``-vN``) is kept."""
    name = os.path.basename(os.path.normpath(output_dir))
    if name == contract.PRECOMPUTED_DIR or name.startswith(contract.PRECOMPUTED_DIR + "-v"):
        return output_dir
    root = os.path.join(output_dir, contract.PRECOMPUTED_DIR)
    if "://" not in root and os.path.islink(root):  # the dataset folder inside the output: never through a link
        raise LinkInOutputError(link_message(output_dir, contract.PRECOMPUTED_DIR))
    return root


def dataset_root(location: str) -> str:
    """The dataset a user names: ``location`` itself, or the ``.precomputed`` folder in it when only that holds a
    diffprep plan (an LTX-layout output is named by the ``--output-dir`` it was written with)."""
    plan = os.path.join(contract.STATE_DIR, contract.PLAN_JSON)
    inner = os.path.join(location, contract.PRECOMPUTED_DIR)
    if not os.path.isfile(os.path.join(location, plan)) and os.path.isfile(os.path.join(inner, plan)):
        return inner
    return location


def folders(plan: Plan) -> list[str]:
    """The record folders a plan writes, the trainer's primary one first (what its t2v / v2v strategies read, and
    the flexible strategy's T2A: ``conditions`` and ``audio_latents``)."""
    video = plan.settings.get("video")
    if video is None:  # audio only: T2A, A2A IC-LoRA, audio inpainting
        inputs = (plan.settings.get("audio") or {}).get("inputs", ())
        return [contract.CONDITIONS_DIR, contract.AUDIO_LATENTS_DIR] + [_INPUT_DIRS[r] for r in inputs]
    kinds = [contract.LATENTS_DIR, contract.CONDITIONS_DIR]
    if video.get("audio"):
        kinds.append(contract.AUDIO_LATENTS_DIR)
    if video.get("reference_scale"):
        kinds.append(contract.REFERENCE_LATENTS_DIR)
    kinds += [_INPUT_DIRS[role] for role in video.get("inputs", ()) if role in _INPUT_DIRS]
    return kinds


# The clip's other inputs (media/clip_inputs.py roles) -> their folder.
_INPUT_DIRS = {"reference_audio": contract.REFERENCE_AUDIO_LATENTS_DIR, "video_mask": contract.VIDEO_MASKS_DIR,
               "audio_mask": contract.AUDIO_MASKS_DIR}


def planned_files(plan: Plan) -> list[str]:
    """Every record file a run of ``plan`` writes (``<folder>/<name>.pt``), whether or not it is written yet."""
    names = [name for name in sample_names(plan).values() if isinstance(name, PurePosixPath)]
    return [f"{kind}/{name}" for kind in folders(plan) for name in names]


def read_by_trainer(path: str) -> bool:
    """Whether the trainer's dataset reads the file at ``path`` (relative to ``.precomputed``): a ``.pt`` below one
    of its record folders (it globs ``<folder>/**/*.pt``)."""
    folder, _, rest = path.partition("/")
    return folder in contract.PRECOMPUTED_DIRS and rest.endswith(contract.PRECOMPUTED_SUFFIX)


class PrecomputedWriter(UnitFilesWriter):
    """Writes one unit's samples as trainer records; ``commit()`` returns the files written (for the manifest)."""

    def __init__(self, root: Path, plan: Plan) -> None:
        super().__init__(root)
        self.plan = plan
        self.kinds = folders(plan)
        self.names = sample_names(plan)

    def refuse(self, source_id: str) -> Reject | None:
        """A sample whose name another sample of the plan owns: a reject naming the owner."""
        name = self.names.get(source_id)
        if isinstance(name, PurePosixPath):
            return None
        return Reject(source_id, "duplicate_media_path",
                      f"its records would be named like those of {name!r} (the trainer names a sample after its "
                      "media path without the extension): list each clip once, under a name of its own",
                      phase="encode")

    def write(self, key: str, fields: Mapping[str, Any]) -> None:
        meta = fields[contract.META]
        name = self.names[meta["source_id"]]
        for kind, record in records(fields).items():
            if kind not in self.kinds:
                continue
            data = torch_bytes(record)
            relative = f"{kind}/{name}"
            self.put(relative, data)
        self.sample_done()


def records(fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """One sample's fields (the Energon layout's) -> its trainer records, per folder."""
    from diffprep.families.ltx2 import AudioLatents, TextConditions
    from diffprep.families.ltx2_precomputed import audio_latents_record, conditions_record, video_latents_record

    meta = fields[contract.META]
    embeds = fields[contract.PROMPT_EMBEDS]
    result = {
        contract.CONDITIONS_DIR: conditions_record(TextConditions(
            video_prompt_embeds=embeds, audio_prompt_embeds=fields.get(contract.AUDIO_PROMPT_EMBEDS, embeds),
            prompt_attention_mask=fields[contract.PROMPT_ATTENTION_MASK], truncated=False)),
    }
    if contract.LATENTS in fields:
        result[contract.LATENTS_DIR] = video_latents_record(fields[contract.LATENTS], fps=meta["fps"])
    if contract.AUDIO_LATENTS in fields:
        result[contract.AUDIO_LATENTS_DIR] = audio_latents_record(
            AudioLatents(fields[contract.AUDIO_LATENTS], duration=meta["audio_duration"]))
    if contract.REFERENCE_LATENTS in fields:
        result[contract.REFERENCE_LATENTS_DIR] = video_latents_record(fields[contract.REFERENCE_LATENTS],
                                                                      fps=meta["fps"])
    if contract.REFERENCE_AUDIO_LATENTS in fields:  # encoded as the clip's sound: the same seconds
        result[contract.REFERENCE_AUDIO_LATENTS_DIR] = audio_latents_record(
            AudioLatents(fields[contract.REFERENCE_AUDIO_LATENTS], duration=meta["audio_duration"]))
    for field, kind in ((contract.VIDEO_MASK, contract.VIDEO_MASKS_DIR), (contract.AUDIO_MASK, contract.AUDIO_MASKS_DIR)):
        if field in fields:
            result[kind] = {"mask": fields[field].contiguous()}
    return result


# --- checking records ------------------------------------------------------------------------------------------


def record_problem(kind: str, record: Any, plan: Plan) -> str | None:
    """What is wrong with a record of folder ``kind`` against A1 and the plan (None: nothing)."""
    expected, dtypes = plan.expected, plan.expected.get("dtypes", {})
    keys = {contract.LATENTS_DIR: contract.VIDEO_RECORD_KEYS,
            contract.REFERENCE_LATENTS_DIR: contract.VIDEO_RECORD_KEYS,
            contract.AUDIO_LATENTS_DIR: contract.AUDIO_RECORD_KEYS,
            contract.REFERENCE_AUDIO_LATENTS_DIR: contract.AUDIO_RECORD_KEYS,
            contract.VIDEO_MASKS_DIR: contract.MASK_RECORD_KEYS,
            contract.AUDIO_MASKS_DIR: contract.MASK_RECORD_KEYS,
            contract.CONDITIONS_DIR: contract.CONDITIONS_RECORD_KEYS}[kind]
    if not isinstance(record, dict) or sorted(record) != sorted(keys):
        return (f"holds {sorted(record) if isinstance(record, dict) else type(record).__name__}, "
                f"expected keys {list(keys)}")
    tensors = {contract.LATENTS_DIR: {"latents": "latents"},
               contract.REFERENCE_LATENTS_DIR: {"latents": "reference_latents"},
               contract.AUDIO_LATENTS_DIR: {"latents": "audio_latents"},
               contract.REFERENCE_AUDIO_LATENTS_DIR: {"latents": "reference_audio_latents"},
               contract.VIDEO_MASKS_DIR: {"mask": "video_mask"},
               contract.AUDIO_MASKS_DIR: {"mask": "audio_mask"},
               contract.CONDITIONS_DIR: {"video_prompt_embeds": "prompt_embeds",
                                         "audio_prompt_embeds": "audio_prompt_embeds"
                                         if "audio_prompt_embeds" in expected else "prompt_embeds",
                                         "prompt_attention_mask": "prompt_attention_mask"}}[kind]
    for key, stem in tensors.items():
        value = record[key]
        if not isinstance(value, torch.Tensor):
            return f"{key} is a {type(value).__name__}, not a tensor"
        want = expected.get(stem)
        if not shape_matches(value.shape, want):
            return f"{key} has shape {list(value.shape)}, the plan writes {want}"
        if dtypes.get(stem) and dtype_name(value.dtype) != dtypes[stem]:
            return f"{key} has dtype {value.dtype}, the trainer reads {dtypes[stem]}"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"{key} has NaN or Inf values"
        if key == "mask" and not bool(((value == 0) | (value == 1)).all()):
            return "mask holds values other than 0 and 1"
    sizes = [k for k in keys if k != "latents" and k in ("num_frames", "height", "width", "num_time_steps",
                                                            "frequency_bins")]
    if any(type(record[k]) is not int for k in sizes) or any(
            type(record[k]) is not float for k in ("fps", "duration") if k in record):
        return "its sizes must be ints and fps/duration floats"
    latents = record.get("latents")
    if kind in (contract.LATENTS_DIR, contract.REFERENCE_LATENTS_DIR) and list(latents.shape[1:]) != [
            record["num_frames"], record["height"], record["width"]]:
        return f"num_frames/height/width {record['num_frames']}/{record['height']}/{record['width']} do not match " \
               f"the latents {list(latents.shape)}"
    return None


def check_shapes(output: Any, plan: Plan, manifests: Mapping[int, UnitManifest]) -> str | None:
    """verify-existing: the first sample of one finished unit, every folder's record, against the plan."""
    for manifest in manifests.values():
        if not manifest.files:
            continue
        name = next(iter(manifest.files)).split("/", 1)[1]
        for kind in folders(plan):
            path = output.local / kind / name
            try:
                problem = record_problem(kind, load_record(path), plan)
            except Exception as error:  # noqa: BLE001 - any unreadable record is a mismatch to report
                problem = f"cannot be read ({type(error).__name__}: {error})"
            if problem:
                return f"{kind}/{name}: {problem}"
        return None
    return None


def audit_unit(output: Any, manifest: UnitManifest, plan: Plan) -> list[str]:
    """A unit's files: every one its manifest lists is there at its size, one per folder per written sample."""
    problems = []
    files = manifest.files or {}
    missing = [name for name, size in files.items() if output.size(name) != size]
    if missing:
        problems.append(f"unit {manifest.unit:06d}: {len(missing)} of its files are missing or changed, e.g. "
                        f"{missing[:3]}")
    for kind in folders(plan):
        count = sum(1 for name in files if name.startswith(kind + "/"))
        if count != manifest.count:
            problems.append(f"unit {manifest.unit:06d}: {count} files in {kind}/ for {manifest.count} samples")
    return problems


def audit_folders(output: Any, plan: Plan, manifests: list[UnitManifest]) -> list[str]:
    """Every required folder holds exactly one ``.pt`` per written sample, under the same names, and no other."""
    listed: dict[str, set[str]] = {kind: set() for kind in folders(plan)}
    for manifest in manifests:
        for name in manifest.files or {}:
            kind, _, relative = name.partition("/")
            listed.setdefault(kind, set()).add(relative)
    written = sum(m.count for m in manifests)
    problems = []
    for kind in folders(plan):
        found = on_disk(output.local / kind)
        extra, lost = sorted(found - listed[kind]), sorted(listed[kind] - found)
        if len(found) != written or extra or lost:
            problems.append(f"{contract.PRECOMPUTED_DIR}/{kind}/ holds {len(found)} .pt files for {written} written "
                            f"samples" + (f"; not in any manifest: {extra[:5]}" if extra else "")
                            + (f"; missing: {lost[:5]}" if lost else ""))
    for kind in sorted(set(contract.PRECOMPUTED_DIRS) - set(folders(plan))):
        stray = on_disk(output.local / kind)
        if stray:
            problems.append(f"{kind}/ holds {len(stray)} files this run does not write (e.g. {sorted(stray)[:3]}): "
                            "the trainer would read them")
    return problems


def on_disk(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*" + contract.PRECOMPUTED_SUFFIX)} \
        if folder.is_dir() else set()


def check_folders(output: Any, plan: Plan, written: int | None) -> list[Check]:
    """The trainer's reading (``PrecomputedDataset``): glob the primary folder, keep a sample only where every other
    folder has the same relative path, load each with weights_only=True; every record checked against A1."""
    kinds = folders(plan)
    primary = on_disk(output.local / kinds[0])
    matching = Findings("matching across folders")
    records_check = Findings("records (keys, shapes, dtypes)")
    for kind in kinds[1:]:
        found = on_disk(output.local / kind)
        if found != primary:
            matching.add(f"{kind}/ has {len(found)} files, {kinds[0]}/ {len(primary)}; "
                         f"without a partner: {sorted(found ^ primary)[:5]}")
    from diffprep.encodings.ltx2_masks import mask_problems

    loaded = 0
    for name in sorted(primary):
        read: dict[str, Any] = {}
        for kind in kinds:
            path = output.local / kind / name
            if not path.is_file():
                continue
            try:
                read[kind] = record = load_record(path)
                problem = record_problem(kind, record, plan)
            except Exception as error:  # noqa: BLE001 - a file the trainer could not load is a finding
                problem = f"torch.load(weights_only=True) refused it ({type(error).__name__}: {error})"
            if problem:
                records_check.add(f"{kind}/{name}: {problem}")
        tensor = lambda kind, key: read[kind].get(key) if isinstance(read.get(kind), dict) else None  # noqa: E731
        for problem in mask_problems(tensor(contract.LATENTS_DIR, "latents"),
                                     tensor(contract.AUDIO_LATENTS_DIR, "latents"),
                                     tensor(contract.VIDEO_MASKS_DIR, "mask"), tensor(contract.AUDIO_MASKS_DIR, "mask")):
            records_check.add(f"{name}: {problem}")
        loaded += 1
    count = Check("samples", bool(primary) and (written is None or len(primary) == written),
                  f"{len(primary)} samples in {kinds[0]}/" + ("" if written is None else f", {written} written"))
    return [count, matching.check(f"{', '.join(k + '/' for k in kinds)} hold the same {len(primary)} names"),
            records_check.check(f"{loaded} samples x {len(kinds)} records load and match the plan")]


def finalize(output: Any, plan: Plan) -> Any:
    """Finalizing the folders: nothing to write (the trainer reads them as they are); the samples they hold."""
    from diffprep.run.energon import FinalizeResult

    written = sum(m.count for m in output.state.manifests().values() if m.fingerprint == plan.fingerprint)
    return FinalizeResult(splits={}, counts={"train": written}, parts=folders(plan), changed=False)


def validate(output: Any, plan: Plan) -> Any:
    """The validation report of an LTX-layout output (``.diffprep/validation.json``), as for a shard dataset."""
    audit = output.state.read_json(contract.AUDIT_JSON)
    written = audit.get("written") if audit else None
    checks = check_folders(output, plan, written)
    summary = {"encoding": plan.encoding, "layout": contract.LAYOUT_LTX, "samples": written,
               "folders": {kind: len(on_disk(output.local / kind)) for kind in folders(plan)}}
    return save_report(output, checks, summary, audit)


def stored_samples(root: Path, plan: Plan, count: int) -> list[tuple[str, str, dict[str, bytes]]]:
    """``count`` committed samples spread over the dataset, as (key, file, the Energon fields) for
    ``diffprep.writer.shards.StoredSample``: the records' tensors, and a meta.json naming the source id, bucket and fps
    (audio only: the duration bucket, no fps)."""
    from diffprep.errors import DatasetValidationError
    from diffprep.writer.shards import json_bytes, read_manifests

    manifests = [m for _, m in sorted(read_manifests(root).items()) if m.keys and m.fingerprint == plan.fingerprint]
    picked = [(m, i) for m in manifests for i in range(len(m.keys))]
    if not picked:
        raise DatasetValidationError(f"{root} has no committed samples (no unit manifest lists any); encode first")
    count = min(count, len(picked))
    names = sample_names(plan)
    kinds = folders(plan)
    samples = []
    for manifest, index in (picked[i * len(picked) // count] for i in range(count)):
        source_id = manifest.source_ids[index]
        name = names[source_id]
        bucket = plan.unit(manifest.unit).bucket
        meta: dict[str, Any] = {"source_id": source_id, "name": str(name), "bucket": bucket}
        fields = {}
        if contract.LATENTS_DIR in kinds:
            video = load_record(root / contract.LATENTS_DIR / name)
            fields[contract.LATENTS] = torch_bytes(video["latents"])
            meta |= {"fps": video["fps"], "bucket": [int(v) for v in bucket.split("x")] if bucket else None}
        for kind, field, key in ((contract.AUDIO_LATENTS_DIR, contract.AUDIO_LATENTS, "latents"),
                                 (contract.REFERENCE_AUDIO_LATENTS_DIR, contract.REFERENCE_AUDIO_LATENTS, "latents"),
                                 (contract.VIDEO_MASKS_DIR, contract.VIDEO_MASK, "mask"),
                                 (contract.AUDIO_MASKS_DIR, contract.AUDIO_MASK, "mask")):
            path = root / kind / name
            if path.is_file():
                fields[field] = torch_bytes(load_record(path)[key])
        fields[contract.META] = json_bytes(meta)
        samples.append((manifest.keys[index], f"{kinds[0]}/{name}", fields))
    return samples
