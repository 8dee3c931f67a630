"""A written caption set read by an encode (``diffprep encode --caption-set NAME``): the set's captions replace the
source's own.

A caption set (``diffprep caption``, ``diffprep.captions.sets``) lives beside the data it captions::

    <captions root>/.captions/<NAME>/set.json        model, prompts, settings, the digest once written
    <captions root>/.captions/<NAME>/index.sqlite    source id -> its captions and token counts (the lookup)

The captions root is ``--captions-dir``, else the directory source's folder or the metadata file's folder. The
lookup is one indexed SQLite query per sample (a 100M-sample set is never held in memory). The set's name and
digest go into the encode's fingerprint (``caption_settings``): a re-captioned set is a new dataset.

This module is the low end of the caption sets (the sources' layer); ``diffprep.captions.sets`` writes them.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from diffprep.errors import RejectError, SourceError

SETS_FOLDER = ".captions"
SET_JSON = "set.json"
INDEX = "index.sqlite"
# The source rejects a caption set answers: a sample without a caption of its own.
ANSWERED_REJECTS = ("missing_caption",)
READ_PHASE = "read"  # diffprep.sources.base.READ_PHASE (base imports this module for the fingerprint)


def captions_root(cfg: Any) -> str:
    """Where the ``.captions`` folder of a source's caption sets is: ``captions_dir``, else beside the data."""
    if getattr(cfg, "captions_dir", None):
        return os.path.abspath(os.path.expanduser(cfg.captions_dir))
    if cfg.type in (None, "directory") and cfg.input_dir and "://" not in cfg.input_dir:
        return os.path.abspath(os.path.expanduser(cfg.input_dir))
    if cfg.metadata_file and "://" not in cfg.metadata_file:
        return os.path.dirname(os.path.abspath(os.path.expanduser(cfg.metadata_file)))
    raise SourceError("caption sets are kept beside the data (a local --input-dir or --metadata-file); for this "
                      "source give the folder to keep them in with --captions-dir DIR")


def set_dir(cfg: Any, name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise SourceError(f"caption set name {name!r}: use letters, digits, '-' and '_' (no '/', not starting with .)")
    return os.path.join(captions_root(cfg), SETS_FOLDER, name)


def read_written_set(path: str) -> dict[str, Any]:
    """set.json of a written set (its captions audited and indexed); an error naming the command otherwise."""
    name = os.path.basename(path)
    try:
        with open(os.path.join(path, SET_JSON), encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise SourceError(f"no caption set {name!r} at {path}: write it first with `diffprep caption --name {name} "
                          "...` (the same source flags)") from None
    if not record.get("digest") or not os.path.exists(os.path.join(path, INDEX)):
        raise SourceError(f"caption set {name!r} at {path} is not written yet (a caption run did not finish): run "
                          "the same `diffprep caption` command again to finish it")
    return record


def caption_set_settings(cfg: Any) -> dict[str, Any]:
    """What the chosen caption set adds to an encode's fingerprint: its name, digest and caption index."""
    record = read_written_set(set_dir(cfg, cfg.caption_set))
    chosen = {"name": cfg.caption_set, "digest": record["digest"], "index": cfg.caption_index}
    if cfg.caption_reject_over:  # over-long captions rejected rather than cut: other samples, another dataset
        chosen["reject_over"] = cfg.caption_reject_over
    return {"caption_set": chosen}


class CaptionIndex:
    """The lookup of a written set: source id -> (captions, token counts by family)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:  # opened in the thread that reads (sqlite connections stay in their thread)
            self._db = sqlite3.connect(f"file:{os.path.join(self.path, INDEX)}?mode=ro", uri=True,
                                       check_same_thread=False)
        return self._db

    def get(self, source_id: str) -> tuple[list[str], dict[str, list[int]]] | None:
        row = self._connect().execute("SELECT captions, tokens FROM captions WHERE source_id = ?",
                                      (source_id,)).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def over(self, family: str, limit: int, index: int = 0, named: int = 20,
             count: Callable[[str], int] | None = None) -> tuple[int, int, list[tuple[str, int]]]:
        """Captions (the ``index``-th of each sample) over ``limit`` of ``family``'s tokens: how many, the longest,
        the first ``named`` (source id, tokens); one pass over the index. ``count``: a caption's tokens where the
        set has no counts of ``family`` (counted now, with the encode's own tokenizer)."""
        total, longest, first = 0, 0, []
        for source_id, captions, tokens in self._connect().execute("SELECT source_id, captions, tokens FROM captions"):
            counts = json.loads(tokens).get(family)
            if not counts and count is not None:
                counts = [count(caption) for caption in json.loads(captions)]
            if not counts:
                continue
            longest = max(longest, counts[index])
            if counts[index] > limit:
                total += 1
                if len(first) < named:
                    first.append((source_id, counts[index]))
        return total, longest, first

    def __getstate__(self) -> dict:  # a worker process opens its own connection
        return {"path": self.path, "_db": None}


class CaptionSetSource:
    """``inner`` with each sample's caption taken from a written caption set (its ``index``-th caption).

    A sample the set has no caption for is a ``caption_set_missing`` reject naming the set; the source's own
    rejects stay, except a missing caption, which the set answers. ``reject_over`` (family, limit): a caption
    longer than ``limit`` of that family's tokens is a ``caption_too_long`` reject (the answer ``reject`` to the
    encode's over-long question).
    """

    def __init__(self, inner: Any, path: str, index: int = 0,
                 reject_over: tuple[str, int] | None = None) -> None:
        self.inner = inner
        self.path = path
        self.name = os.path.basename(path)
        self.index = index
        self.reject_over = reject_over
        self.lookup = CaptionIndex(path)
        record = read_written_set(path)
        per_sample = len(record.get("instructions", [None]))
        if not 0 <= index < per_sample:
            raise SourceError(f"--caption-index {index}: caption set {self.name!r} has {per_sample} caption(s) per "
                              f"sample (0 to {per_sample - 1})")
        self.stamps = getattr(inner, "stamps", None)

    def list_ids(self) -> Iterator[str]:
        return self.inner.list_ids()

    def describe(self) -> dict:
        return self.inner.describe() | {"caption_set": self.name}

    def read(self, ids: Sequence[str]) -> Iterator[Any]:
        for sample in self.inner.read(ids):
            yield self._captioned(sample)

    def _captioned(self, sample: Any) -> Any:
        if sample.reject is not None and sample.reject.reason not in ANSWERED_REJECTS:
            return sample
        found = self.lookup.get(sample.source_id)
        if found is None or found[0] is None:
            return replace(sample, caption=None, reject=RejectError(
                "caption_set_missing", f"caption set {self.name!r} ({self.path}) has no caption for this sample: "
                "re-run `diffprep caption` with the same settings to caption new samples", phase=READ_PHASE))
        captions, tokens = found
        if self.reject_over is not None:
            family, limit = self.reject_over
            count = (tokens.get(family) or [None] * len(captions))[self.index]
            if count is not None and count > limit:
                return replace(sample, caption=None, reject=RejectError(
                    "caption_too_long", f"its caption from set {self.name!r} is {count} {family} tokens, over the "
                    f"text encoder's {limit} (rejected as answered; answer truncate to keep it cut)", phase=READ_PHASE))
        return replace(sample, caption=captions[self.index], reject=None)


__all__ = ["INDEX", "SETS_FOLDER", "SET_JSON", "CaptionIndex", "CaptionSetSource", "caption_set_settings",
           "captions_root", "read_written_set", "set_dir"]
