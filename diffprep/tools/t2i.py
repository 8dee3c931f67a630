"""``diffprep t2i imagenet``: a class-folder tree packed as GAE's ImageNet text-to-image shards.

GAE's codec and flow co-train a text-to-image branch on WebDataset shards that
its loader (``src/data/blip3o_wds.py``) reads from ``<root>/ImageNet-1K-T2I/``;
its packer is ``scripts/prepare_t2i_data.py imagenet --mode wds``. This writes
that folder the way the loader reads it:

- shards ``imagenet_00000.tar`` … of ``--shard-size`` samples (10,000, GAE's default);
- per sample ``<key>.<ext>``, the ORIGINAL file bytes, never re-encoded, and
  ``<key>.txt``, the caption; key ``imagenet_<wnid>_<stem>``. The extension is
  the one the bytes are (sniffed, not the file name's): ``jpg`` for JPEG,
  ``png`` / ``webp`` otherwise. GAE's loader takes any of ``jpg png jpeg webp``
  and decodes by content, so keeping a PNG as ``.png`` loses nothing and
  misnames nothing (GAE's packer calls every file ``.jpg``);
- samples shuffled across classes with a fixed seed (``--seed``), so a shard
  holds many classes (GAE's packer writes them class by class);
- ``<shard>.done`` beside each finished shard, which GAE's loader requires and
  GAE's packer never writes.

The commit point is diffprep's: a shard is written under a temporary name,
fsynced and renamed, then its unit manifest (``.diffprep/units/<i>.json``,
listing the shard and its ``.done`` as its files), then the ``.done``. A shard
without a manifest is not done, whatever files exist: a resumed run writes it
again; a manifest without its ``.done`` gets the marker. The plan
(``.diffprep/t2i_plan.json``) holds the seed, shard size, caption settings and
every shard's source ids: a re-run over a grown tree keeps every planned shard
and plans shuffled new shards for the new files only; files that disappeared
are reported and their shards kept. An overwrite removes only what the
manifests list (``ownership.py`` reads the same records).

No Energon metadata: GAE's loader reads the tars directly (``.nv-meta`` would be
ignored), so there is no finalize; ``diffprep verify-t2i`` is the check.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import random
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image

from diffprep import contract
from diffprep.errors import ConfigError, RejectError
from diffprep.output.base import Output
from diffprep.output.locks import OutputLock
from diffprep.validation.ownership import refuse_links
from diffprep.writer.plan import fingerprint
from diffprep.writer.shards import (
    Reject,
    UnitManifest,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    read_manifests,
    temp_name,
    write_manifest,
)
from diffprep.sources.base import reject
from diffprep.sources.imagefolder import ImageFolderSource

DEFAULT_SHARD_SIZE = contract.T2I_SHARD_SIZE
DEFAULT_SEED = contract.T2I_SEED
PLAN_VERSION = 1
MEMBER_MODE = 0o644
# Pillow's format name -> the member extension the bytes are kept under.
_FORMAT_MEMBER = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


@dataclass
class T2IPlan:
    """``.diffprep/t2i_plan.json``: what decides the bytes, and every shard's source ids in written order."""

    seed: int
    shard_size: int
    captions: dict  # caption template, where the names came from, their sha256
    source: dict
    shards: list[list[str]] = field(default_factory=list)
    version: int = PLAN_VERSION

    @property
    def fingerprint(self) -> str:
        return fingerprint({"t2i": "imagenet", "seed": self.seed, "shard_size": self.shard_size,
                            "template": self.captions["template"]})

    def renamed(self, captions: dict) -> list[str]:
        """The planned classes whose name ``captions`` changes."""
        return [f"{folder}: {name!r} -> {captions['names'].get(folder)!r}" for folder, name in
                self.captions["names"].items() if captions["names"].get(folder, name) != name]

    @classmethod
    def read(cls, path: Path) -> T2IPlan | None:
        import json

        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text(encoding="utf-8")))


@dataclass(frozen=True)
class PackResult:
    out: Path
    shards: int
    written: list[str]  # shard names written by this run
    samples: int  # samples in every committed shard
    rejects: list[Reject]
    vanished: list[str]  # planned source ids no longer in the tree


def caption_identity(source: ImageFolderSource) -> dict:
    """The caption settings a plan keeps: the template and each class folder's name (a grown tree may add classes;
    a planned class must keep its name, or its shards' captions would not be this run's)."""
    return {"template": source.describe()["caption_template"], "names_from": source.names_from,
            "names": dict(zip(source.classes, source.class_names))}


def plan_shards(source: ImageFolderSource, out: Path, *, seed: int, shard_size: int) -> tuple[T2IPlan, list[str]]:
    """The plan for ``out``: the existing one extended by shards of the new ids (shuffled), and the vanished ids."""
    if shard_size < 1:
        raise ConfigError(f"--shard-size must be >= 1, got {shard_size}")
    path = out / contract.STATE_DIR / contract.T2I_PLAN_JSON
    ids = list(source.list_ids())
    fresh = T2IPlan(seed, shard_size, caption_identity(source), source.describe())
    plan = T2IPlan.read(path)
    if plan is None:
        if any(entry.name != contract.STATE_DIR for entry in out.iterdir()):
            raise ConfigError(f"{out} is not empty and holds no T2I plan ({contract.STATE_DIR}/"
                              f"{contract.T2I_PLAN_JSON}): give an empty or new --output folder")
        plan = fresh
    elif plan.fingerprint != fresh.fingerprint or plan.renamed(fresh.captions):
        raise ConfigError(f"{out} was packed with seed {plan.seed}, shard size {plan.shard_size} and caption "
                          f"template {plan.captions['template']!r}; this run asks for seed {seed}, shard size "
                          f"{shard_size} and {fresh.captions['template']!r}"
                          + "".join(f"; renamed {line}" for line in plan.renamed(fresh.captions)[:5])
                          + ". Pass the same settings to resume or append, or give a new --output folder")
    planned = {source_id for shard in plan.shards for source_id in shard}
    present = set(ids)
    new = [source_id for source_id in ids if source_id not in planned]
    # One generator per append, seeded by the seed and the shards already planned: resumes replan nothing,
    # and an append shuffles its own files the same way every time it is planned.
    random.Random(f"{plan.seed}/{len(plan.shards)}").shuffle(new)
    plan.shards.extend(new[start:start + plan.shard_size] for start in range(0, len(new), plan.shard_size))
    plan.source, plan.captions = fresh.source, {**plan.captions, "names": {**plan.captions["names"],
                                                                          **fresh.captions["names"]}}
    return plan, sorted(planned - present)


def member_of(sample_bytes: bytes, where: str) -> str:
    """The member extension the image's bytes are (not its file name's); an undecodable file is a reject."""
    try:
        with Image.open(io.BytesIO(sample_bytes)) as image:
            kind = image.format
            image.verify()
    except Exception as error:  # noqa: BLE001 - any undecodable image is that sample's reject
        raise reject("image_decode_error", f"{where}: {type(error).__name__}: {error}") from None
    if kind not in _FORMAT_MEMBER:
        raise reject("unsupported_format", f"{where}: a {kind} image; GAE's loader reads "
                     f"{'/'.join(contract.T2I_IMAGE_MEMBERS)} members")
    return _FORMAT_MEMBER[kind]


def sample_key(source_id: str) -> str:
    """``imagenet_<wnid>_<stem>`` of ``<wnid>/<path>/<stem>.<ext>``; a stem with a dot cannot be a key."""
    wnid, _, rest = source_id.partition("/")
    stem = posixpath.splitext(posixpath.basename(rest))[0]
    if "." in stem or "." in wnid:
        raise reject("invalid_key", f"{source_id}: a dot in {wnid!r} or {stem!r}; WebDataset keys end at the "
                     "first dot")
    return contract.t2i_key(wnid, stem)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, MEMBER_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_shard(out: Path, index: int, source: ImageFolderSource, ids: Sequence[str], fp: str,
                taken: set[str]) -> UnitManifest:
    """Shard ``index`` of the plan, committed: tar renamed into place, then its manifest. ``taken``: keys of
    other shards (a key seen twice is a ``duplicate_key`` reject: GAE's key keeps only the file's stem)."""
    name = contract.t2i_shard_name(index)
    tmp_dir = out / contract.STATE_DIR / contract.TMP_DIR
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / temp_name(name)
    keys, written_ids, rejects = [], [], []
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w", format=tarfile.GNU_FORMAT) as tar:
                for sample in source.read(ids):
                    try:
                        if sample.reject is not None:
                            raise sample.reject
                        key = sample_key(sample.source_id)
                        if key in taken:
                            raise reject("duplicate_key", f"{sample.source_id}: key {key} is another file's "
                                         "(same class and stem)")
                        member = member_of(sample.image, sample.source_id)
                    except RejectError as error:
                        rejects.append(Reject(sample.source_id, error.reason, error.detail, error.phase))
                        continue
                    taken.add(key)
                    _add(tar, f"{key}.{member}", sample.image)
                    _add(tar, f"{key}.{contract.T2I_CAPTION}", (sample.caption or "").encode("utf-8"))
                    keys.append(key)
                    written_ids.append(sample.source_id)
            handle.flush()
            os.fsync(handle.fileno())
        with open(tmp, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
                size += len(chunk)
        os.replace(tmp, out / name)
        fsync_dir(out)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = UnitManifest(unit=index, shard=name, fingerprint=fp, keys=keys, source_ids=written_ids,
                            count=len(keys), bytes=size, sha256=digest.hexdigest(), rejects=rejects,
                            files={name: size, contract.t2i_done_name(name): 0})
    write_manifest(out, manifest)  # the commit point; the .done marker follows it
    return manifest


def split_folder(out_dir: str) -> Path:
    """``out_dir`` resolved, when it is named as GAE's loader names the ImageNet split (``ImageNet-1K-T2I``): the
    loader looks only for ``<data_dir>/ImageNet-1K-T2I/*.tar``, so shards under any other name would never be read,
    whatever ``data_dir`` says."""
    out = Path(out_dir).expanduser().resolve()
    folder = contract.T2I_SPLIT_FOLDERS["imagenet"]
    if out.name != folder:
        raise ConfigError(f"--output {out_dir}: GAE's T2I loader reads ImageNet shards only from <data_dir>/{folder}/, "
                          f"never from a folder named {out.name!r}: pass --output {out / folder} (GAE's data_dir "
                          f"{out}) or --output {out.parent / folder} (data_dir {out.parent})")
    return out


def pack_imagenet(input_dir: str, out_dir: str, *, shard_size: int = DEFAULT_SHARD_SIZE, seed: int = DEFAULT_SEED,
                  class_names: str | None = None, caption_template: str | None = None,
                  progress: Callable[[str], None] = lambda line: None) -> PackResult:
    """Pack (or resume, or append to) ``out_dir`` (the module docstring), the split folder GAE's loader looks for:
    any other name is refused before anything is read or written (``split_folder``)."""
    out = split_folder(out_dir)
    source = ImageFolderSource(input_dir, class_names=class_names, caption_template=caption_template)
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        plan, vanished = plan_shards(source, out, seed=seed, shard_size=shard_size)
        names = [contract.t2i_shard_name(index) for index in range(len(plan.shards))]
        refuse_links(Output(out), writes={*names, *map(contract.t2i_done_name, names)})
        atomic_write_json(out / contract.STATE_DIR / contract.T2I_PLAN_JSON, asdict(plan))
        manifests = read_manifests(out)
        taken = {key for index, m in manifests.items() if index < len(plan.shards) for key in m.keys}
        written = []
        for index, ids in enumerate(plan.shards):
            manifest = manifests.get(index)
            if manifest is None or manifest.fingerprint != plan.fingerprint:
                manifest = write_shard(out, index, source, ids, plan.fingerprint, taken)
                manifests[index] = manifest
                written.append(manifest.shard)
                progress(f"{manifest.shard}: {manifest.count} samples, {len(manifest.rejects)} rejected")
            done = out / contract.t2i_done_name(manifest.shard)
            if not done.exists():
                atomic_write_bytes(done, b"")
    committed = [manifests[index] for index in range(len(plan.shards))]
    return PackResult(out, len(plan.shards), written, sum(m.count for m in committed),
                      [r for m in committed for r in m.rejects], vanished)
