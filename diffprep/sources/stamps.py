"""A source's stamp: what says, without listing it, that a source is as it was when it was planned.

A re-run over a finished output lists the source again only to learn that nothing is new: at 1M rows of a
metadata file that is two whole-file passes (its columns, then its rows), at 100M the better part of an hour. A
source whose input files carry a stamp that changes when they do is listed only when the stamp changed
(``diffprep.phases.fetch``; the plan records the stamp, outside the fingerprint).

A stamp is taken from the settings, before and without listing: a local file's size, mtime_ns, ctime_ns and
inode (a file rewritten in place, even to the same size and mtime, gets a new ctime; one replaced by a rename a
new inode); an object's size and ETag (one HEAD, or the listing of a webdataset's tars). The source settings and
the planning settings that decide the listing (shard size, max samples) are part of it, hashed. Sources whose
listing has no cheap stamp (folders of files, Hugging Face datasets, class folders, CIFAR, scenes, a caption
set) get ``None``: they are listed again as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from diffprep.config import SourceConfig
from diffprep.errors import SourceError
from diffprep.sources.storage import glob_objects, is_s3_url, object_stamp, parse_s3_url, s3_client
from diffprep.sources.webdataset import _LocalShards


def source_stamp(cfg: SourceConfig, **planning: Any) -> dict[str, Any] | None:
    """The stamp of the source ``cfg`` describes, or None where it cannot tell cheaply (list it again).

    ``planning``: the other settings the listing's plan depends on (``shard_size``, ``max_samples``). The stamp
    is ``{"settings": <hash>, "files": <count>, "bytes": <total size>, "digest": <hash of every file's stamp>}``:
    small whatever the number of files, compared whole.
    """
    if getattr(cfg, "caption_set", None):
        return None  # the captions of a set change without the source's files changing
    try:
        if cfg.type == "metadata" and cfg.metadata_file:
            files = metadata_stamps(cfg)
        elif cfg.type == "webdataset" and cfg.input_path:
            files = webdataset_stamps(cfg)
        else:
            return None
    except (OSError, SourceError):
        return None  # opening the source says what is wrong; listing finds what is there
    if files is None:
        return None
    settings = json.dumps([cfg.model_dump(mode="json"), planning], sort_keys=True, default=str)
    digest = hashlib.sha256()
    for name, stamp in sorted(files.items()):
        digest.update(f"{name}\0{stamp}\n".encode("utf-8", "surrogateescape"))
    return {
        "settings": hashlib.sha256(settings.encode("utf-8")).hexdigest()[:16],
        "files": len(files),
        "bytes": sum(int(stamp.split(":", 1)[0]) for stamp in files.values()),
        "digest": digest.hexdigest()[:32],
    }


def describe_stamp(stamp: dict[str, Any]) -> str:
    """One line for the log: how many files, how many bytes, the digest."""
    files = stamp.get("files", 0)
    return (f"{files} input file{'' if files == 1 else 's'}, {stamp.get('bytes', 0):,} bytes, "
            f"stamps {str(stamp.get('digest', ''))[:12]}")


def local_stamp(path: str) -> str:
    """``<size>:<mtime_ns>:<ctime_ns>:<inode>`` of a local file (``OSError`` when there is none)."""
    info = os.stat(path)
    return f"{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}:{info.st_ino}"


def metadata_stamps(cfg: SourceConfig) -> dict[str, str] | None:
    """The metadata file's stamp (a stat, or a HEAD in a bucket): its rows are the listing."""
    if is_s3_url(cfg.metadata_file):
        url = parse_s3_url(cfg.metadata_file, "source.metadata_file")
        stamp = object_stamp(s3_client(cfg.s3_endpoint_url, cfg.s3_profile), url)
        return None if stamp == "-" or not stamp.split(":", 1)[1] else {str(url): stamp}
    path = os.path.abspath(os.path.expanduser(cfg.metadata_file))
    return {path: local_stamp(path)}


def webdataset_stamps(cfg: SourceConfig) -> dict[str, str] | None:
    """Every input tar's stamp: the glob's files (a stat each), or its objects (size and ETag from the listing).
    A tar added, removed or rewritten changes the set."""
    if is_s3_url(cfg.input_path):
        pattern = parse_s3_url(cfg.input_path, "source.input_path")
        client = s3_client(cfg.s3_endpoint_url, cfg.s3_profile)
        found = {f"{pattern.bucket}/{info.key}": f"{info.size}:{info.etag}" for info in glob_objects(client, pattern)}
        if any(not stamp.split(":", 1)[1] for stamp in found.values()):
            return None  # an endpoint that gives no ETag: nothing says a rewritten tar changed
        return found or None
    if "://" in cfg.input_path:
        return None
    # The webdataset reader's own glob (braces, wildcards, relative ids), so that the stamp covers the tars it lists.
    shards = _LocalShards(cfg.input_path)
    return {shard: local_stamp(shards.where(shard)) for shard in shards.shards}


__all__ = ["describe_stamp", "local_stamp", "metadata_stamps", "source_stamp", "webdataset_stamps"]
