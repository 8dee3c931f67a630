"""``--layout gae``: posed scenes written as GAE's scene folders, with diffprep's safety.

``<out>/<scene>/`` per sample (the scene id is its folder relative to the input,
with the split first where the format has one: RE10K's ``train/<scene>``, as
GAE's configs read ``re10k_packed/train``; a chunk of a long scene is its
``<scene>/chunk_NNN/``), holding

- ``video.mp4``: the kept frames, H.264 (``diffprep.media.mp4``, reproducible bytes);
- ``meta.json``: every scalar first (``scene_id, num_frames, fps, height, width,
  rgb_resolution, source``, the sampling settings, ``caption``), then
  ``frames: [{index, name, original_idx, c2w, K}]`` — GAE's index
  (``fast_meta_index.py``) parses only the text before the first ``"frames"`` key,
  so nothing it reads may come after it (``gae_prefix`` reads it the same way);
- ``caption.txt``: the caption (GAE's flow loader reads it first), in chunk folders too;
- ``depth.npz`` (depth sources): ``depth_mm`` uint16 ``[N, d, d]``, a zip whose
  entry dates and attributes are fixed so the same maps give the same bytes.

A unit writes its scenes' files atomically and its manifest last, listing every
file and its size (the commit point, as for the LTX layout); a unit that fails
removes what it wrote. A scene folder that another sample of the plan already
owns, or an id that is no safe relative path, is a named reject. The audit
checks each unit's files and that every ``meta.json`` under the output is a
committed scene's; validation reads every scene as GAE does (the meta prefix,
the frames, caption.txt) and checks every camera, the mp4's decoded frame
count and the depth maps (``scenes.check_scene``). No ``chunks_manifest.json``
is written: GAE's loader then takes the ``chunk_*`` folders.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import numpy as np

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.writer.layouts import Layout
from diffprep.encodings.unit_files import UnitFilesWriter, save_report
from diffprep.writer.plan import Plan
from diffprep.writer.shards import Reject, UnitManifest
from diffprep.sources.base import unescape_id

UNIT_FILES = True  # its units write files, not shards (diffprep.encodings.unit_files_layout)
META_PREFIX_BYTES = 128 * 1024  # what GAE's index reads of a meta.json
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
FILES = (contract.GAE_VIDEO, contract.GAE_META, contract.GAE_CAPTION, contract.GAE_DEPTH)


def is_gae(plan: Plan | None) -> bool:
    return plan is not None and Layout.of_plan(plan.settings).name == contract.LAYOUT_GAE


_CHUNK = re.compile(r"^(?P<scene>.+)/(?P<chunk>chunk_\d{3,})$")
# Where GAE's packers put a scene of each format: RE10K under <split>/<scene>, DL3DV under <scene> (its split
# dropped), the others (ScanNet++, MVS-Synth, people's own captures) under their id as it is.
_FOLDER_RULES = {"re10k": "split/name", "dl3dv": "name"}


def folder_of(source_id: str, scene_format: str | None = None) -> str | None:
    """A scene's folder under the output, from its id (``<scene>/chunk_NNN``: the chunk's folder inside its scene's)
    and format (``_FOLDER_RULES``); None: not a relative path of plain folder names."""
    match = _CHUNK.match(source_id)
    scene, chunk = (match["scene"], match["chunk"]) if match else (source_id, None)
    parts = [p for p in unescape_id(scene).split("/") if p]
    if not parts or any(p in ("..", ".") or p.startswith(".") or "\\" in p for p in parts):
        return None
    rule = _FOLDER_RULES.get(scene_format or "")
    if rule == "name" or (rule == "split/name" and len(parts) == 1):
        parts = parts[-1:]
    elif rule == "split/name":
        parts = [parts[0], parts[-1]]
    return PurePosixPath(*parts, *([chunk] if chunk else [])).as_posix()


def folders(plan: Plan) -> dict[str, str | None]:
    """Source id -> its folder, or None where the id is unusable or another id of the plan owns the folder."""
    owners: dict[str, str] = {}
    result: dict[str, str | None] = {}
    scene_format = plan.settings["scenes"]["format"]
    for unit in plan.units:
        for source_id in unit.source_ids:
            folder = folder_of(source_id, scene_format)
            if folder is not None and owners.setdefault(folder, source_id) != source_id:
                folder = None
            result[source_id] = folder
    return result


def files_of(plan: Plan) -> tuple[str, ...]:
    depth = bool(plan.settings["scenes"].get("depth"))
    return FILES if depth else FILES[:3]


def planned_files(plan: Plan) -> list[str]:
    """Every file a run of ``plan`` writes, whether or not it is written yet."""
    names = files_of(plan)
    return [f"{folder}/{name}" for folder in folders(plan).values() if folder for name in names]


def read_by_trainer(path: str) -> bool:
    """Whether GAE reads the file at ``path``: a scene file in any folder below the output."""
    return "/" in path and path.rsplit("/", 1)[1] in FILES and not path.startswith(contract.STATE_DIR + "/")


# --- the files of one scene -------------------------------------------------------------------------------------


def meta_bytes(meta: Mapping[str, Any]) -> bytes:
    """meta.json as written: keys in their order (scalars before ``frames``), compact, UTF-8."""
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def depth_npz(depth: np.ndarray) -> bytes:
    """``depth_mm`` in an npz that ``np.load`` reads, with fixed entry dates: the same maps, the same bytes."""
    array = io.BytesIO()
    np.save(array, np.ascontiguousarray(depth, dtype=np.uint16), allow_pickle=False)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        entry = zipfile.ZipInfo(f"{contract.GAE_DEPTH_KEY}.npy", date_time=_ZIP_DATE)
        entry.compress_type = zipfile.ZIP_DEFLATED
        entry.external_attr = 0o644 << 16
        archive.writestr(entry, array.getvalue(), compresslevel=6)
    return buffer.getvalue()


def scene_files(fields: Mapping[str, Any]) -> dict[str, bytes]:
    """One scene's fields (``scenes.SceneWriter``'s) -> its folder's files."""
    from diffprep.encodings.scene_checks import load_npy

    files = {contract.GAE_VIDEO: fields[contract.RAW_VIDEO], contract.GAE_META: meta_bytes(fields[contract.RAW_VIDEO_META]),
             contract.GAE_CAPTION: fields[contract.RAW_CAPTION].encode("utf-8")}
    if contract.SCENE_DEPTH in fields:
        files[contract.GAE_DEPTH] = depth_npz(load_npy(fields[contract.SCENE_DEPTH], key="?", field="depth"))
    return files


class SceneFolderWriter(UnitFilesWriter):
    """Writes one unit's scenes as folders; ``commit()`` returns the files written (for the manifest)."""

    def __init__(self, root: Path, plan: Plan) -> None:
        super().__init__(root)
        self.format = plan.settings["scenes"]["format"]
        self.folders = folders(plan)

    def refuse(self, source_id: str) -> Reject | None:
        if self.folders.get(source_id):
            return None
        folder = folder_of(source_id, self.format)
        if folder is None:
            return Reject(source_id, "unsafe_scene_id", "its id is not a relative path of plain folder names, so it "
                          "cannot name a scene folder", phase="encode")
        return Reject(source_id, "duplicate_scene_folder", f"another scene of the plan is written to {folder!r} (GAE "
                      "names a scene's folder after the scene, without the folders above it): give each scene a "
                      "name of its own", phase="encode")

    def write(self, key: str, fields: Mapping[str, Any]) -> None:
        folder = self.folders[fields[contract.RAW_VIDEO_META]["source_id"]]
        for name, data in scene_files(fields).items():
            relative = f"{folder}/{name}"
            self.put(relative, data)
        self.sample_done()


# --- reading a scene as GAE does ----------------------------------------------------------------------------------


def gae_prefix(text: str) -> dict[str, Any]:
    """What GAE's index takes from a meta.json: its first 128 KiB cut before the first ``"frames"`` key, parsed."""
    head = text[:META_PREFIX_BYTES]
    cut = head.find('"frames"')
    if cut < 0:
        raise ValueError('no "frames" key in the first 128 KiB')
    prefix = head[:cut].rstrip().rstrip(",") + "}"
    return json.loads(prefix)


def read_scene(root: Path, folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta.json, the fields ``scenes.check_scene`` and ``diffprep decode`` read) of one written scene folder."""
    from diffprep.encodings.scene_checks import intrinsics_rows, npy

    base = root / folder
    meta = json.loads((base / contract.GAE_META).read_text(encoding="utf-8"))
    frames = meta.get("frames") or []
    c2w = np.array([f["c2w"] for f in frames], dtype=np.float32).reshape(-1, 4, 4)
    K = np.array([f["K"] for f in frames], dtype=np.float64).reshape(-1, 3, 3)
    fields = {contract.RAW_VIDEO: (base / contract.GAE_VIDEO).read_bytes(),
              contract.RAW_CAPTION: (base / contract.GAE_CAPTION).read_bytes(),
              contract.SCENE_POSES: npy(c2w), contract.SCENE_INTRINSICS: npy(intrinsics_rows(K)),
              contract.RAW_VIDEO_META: json.dumps({k: v for k, v in meta.items() if k != "frames"}).encode()}
    if (base / contract.GAE_DEPTH).is_file():
        with np.load(base / contract.GAE_DEPTH, allow_pickle=False) as archive:
            fields[contract.SCENE_DEPTH] = npy(archive[contract.GAE_DEPTH_KEY])
    return meta, fields


def scene_problems(root: Path, folder: str, expected: Mapping[str, Any] | None) -> list[str]:
    """Everything wrong with one written scene folder, read as GAE reads it."""
    from diffprep.encodings.scene_checks import check_scene, load_npy

    try:
        text = (root / folder / contract.GAE_META).read_text(encoding="utf-8")
        prefix = gae_prefix(text)
        meta, fields = read_scene(root, folder)
    except Exception as error:  # noqa: BLE001 - a scene GAE could not read is a finding
        return [f"{folder}: cannot be read as GAE reads it ({type(error).__name__}: {error})"]
    problems = []
    missing = [k for k in ("num_frames", "rgb_resolution", "caption") if k not in prefix]
    if missing:
        problems.append(f"{folder}/meta.json: {missing} not before \"frames\" (GAE's index reads only that prefix)")
    if len(meta.get("frames") or []) != meta.get("num_frames"):
        problems.append(f"{folder}/meta.json: {len(meta.get('frames') or [])} frames, num_frames {meta.get('num_frames')}")
    if fields[contract.RAW_CAPTION].decode("utf-8", "replace") != meta.get("caption"):
        problems.append(f"{folder}/caption.txt differs from meta.json's caption")
    depth = load_npy(fields[contract.SCENE_DEPTH], key=folder, field="depth") if contract.SCENE_DEPTH in fields else None
    key = folder
    problems += check_scene(key, fields[contract.RAW_VIDEO], load_npy(fields[contract.SCENE_POSES], key=key, field="c2w"),
                            load_npy(fields[contract.SCENE_INTRINSICS], key=key, field="K"), meta, depth, expected)
    return problems


# --- the pipeline's hooks (as ltx_layout's) -----------------------------------------------------------------------


def _committed(output: Any, plan: Plan) -> list[UnitManifest]:
    return [m for _, m in sorted(output.state.manifests().items()) if m.fingerprint == plan.fingerprint]


def _scene_folders(manifest: UnitManifest) -> list[str]:
    return sorted({name.rsplit("/", 1)[0] for name in manifest.files or {}})


def check_shapes(output: Any, plan: Plan, manifests: Mapping[int, UnitManifest]) -> str | None:
    """verify-existing: the first scene of one finished unit, read and checked against the plan."""
    for manifest in manifests.values():
        for folder in _scene_folders(manifest)[:1]:
            problems = scene_problems(output.local, folder, plan.expected.get("scene"))
            return problems[0] if problems else None
    return None


def audit_unit(output: Any, manifest: UnitManifest, plan: Plan) -> list[str]:
    """A unit's files: every one its manifest lists is there at its size; one folder of every file per scene."""
    files = manifest.files or {}
    problems = []
    changed = [name for name, size in files.items()
               if not (output.local / name).is_file() or (output.local / name).stat().st_size != size]
    if changed:
        problems.append(f"unit {manifest.unit:06d}: {len(changed)} of its files are missing or changed, e.g. "
                        f"{changed[:3]}")
    for name in files_of(plan):
        count = sum(1 for path in files if path.rsplit("/", 1)[-1] == name)
        if count != manifest.count:
            problems.append(f"unit {manifest.unit:06d}: {count} {name} files for {manifest.count} scenes")
    return problems


def on_disk(root: Path) -> set[str]:
    """Every scene folder below ``root`` (a folder holding a meta.json), outside diffprep's state."""
    return {p.parent.relative_to(root).as_posix() for p in root.rglob(contract.GAE_META)
            if not p.relative_to(root).as_posix().startswith(contract.STATE_DIR + "/")} if root.is_dir() else set()


def audit_folders(output: Any, plan: Plan, manifests: list[UnitManifest]) -> list[str]:
    """Every scene folder under the output is a committed scene's, and every committed one is there."""
    listed = {folder for m in manifests for folder in _scene_folders(m)}
    found = on_disk(output.local)
    extra, lost = sorted(found - listed), sorted(listed - found)
    if extra or lost:
        return [f"{len(found)} scene folders (with a meta.json) for {len(listed)} committed scenes"
                + (f"; not in any manifest: {extra[:5]} (GAE would read them)" if extra else "")
                + (f"; missing: {lost[:5]}" if lost else "")]
    return []


def finalize(output: Any, plan: Plan) -> Any:
    """Nothing to write (GAE reads the folders as they are); the scenes they hold."""
    from diffprep.run.energon import FinalizeResult

    written = sum(m.count for m in _committed(output, plan))
    tops = sorted({folder.split("/", 1)[0] for folder in folders(plan).values() if folder})  # splits, or scenes
    return FinalizeResult(splits={}, counts={"train": written}, parts=tops, changed=False)


def validate(output: Any, plan: Plan) -> Any:
    """Every committed scene read as GAE reads it and checked; the report (``.diffprep/validation.json``)."""
    audit = output.state.read_json(contract.AUDIT_JSON)
    written = audit.get("written") if audit else None
    committed = [folder for m in _committed(output, plan) for folder in _scene_folders(m)]
    scenes = Findings("scenes")
    frames = 0
    for folder in committed:
        for problem in scene_problems(output.local, folder, plan.expected.get("scene")):
            scenes.add(problem)
        try:
            frames += int(json.loads((output.local / folder / contract.GAE_META).read_text())["num_frames"])
        except Exception:  # noqa: BLE001 - already a finding
            pass
    count = Check("samples", bool(committed) and (written is None or len(committed) == written),
                  f"{len(committed)} scene folders" + ("" if written is None else f", {written} written"))
    extra = sorted(on_disk(output.local) - set(committed))
    stray = Check("no other scene folders", not extra, f"not written by this plan, GAE would read them: {extra[:5]}"
                  if extra else "every scene folder is a committed scene")
    checks = [count, stray, scenes.check(f"{len(committed)} scenes, {frames} frames: meta.json read as GAE's index "
                                         "reads it, every camera valid, every mp4 decodes to num_frames")]
    summary = {"encoding": plan.encoding, "layout": contract.LAYOUT_GAE, "samples": written, "scenes": len(committed),
               "frames": frames}
    return save_report(output, checks, summary, audit)


def stored_samples(root: Path, plan: Plan, count: int) -> list[tuple[str, str, dict[str, bytes]]]:
    """``count`` committed scenes spread over the dataset as (key, folder, the shard layout's fields) for
    ``diffprep decode``."""
    from diffprep.errors import DatasetValidationError
    from diffprep.writer.shards import read_manifests

    picked = []
    names = folders(plan)
    for _, manifest in sorted(read_manifests(root).items()):
        if manifest.fingerprint == plan.fingerprint:
            by_folder = _scene_folders(manifest)
            for key, source_id in zip(manifest.keys, manifest.source_ids):
                if names.get(source_id) in by_folder:
                    picked.append((key, names[source_id], source_id))
    if not picked:
        raise DatasetValidationError(f"{root} has no committed scenes (no unit manifest lists any); run it first")
    count = min(count, len(picked))
    samples = []
    for key, folder, source_id in (picked[i * len(picked) // count] for i in range(count)):
        meta, fields = read_scene(root, folder)
        fields[contract.RAW_VIDEO_META] = json.dumps({k: v for k, v in meta.items() if k != "frames"}
                                                     | {"source_id": source_id}).encode()
        samples.append((key, folder, fields))
    return samples


__all__ = ["SceneFolderWriter", "audit_folders", "audit_unit", "check_shapes", "depth_npz", "finalize", "folder_of",
           "gae_prefix", "is_gae", "meta_bytes", "planned_files", "read_by_trainer", "read_scene", "scene_files",
           "scene_problems", "stored_samples", "validate"]
