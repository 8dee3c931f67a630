"""Text encodings computed once per distinct caption: a per-process cache, bounded in bytes, least recently used out.

A cache belongs to one loaded encoder set (``FluxEncoders``, ``WanEncoders``):
its key is the caption, and the set it belongs to is the text encoders'
identity (the ``encoders`` part of the plan's fingerprint: components, dtype,
token length), so an entry is never used by other encoders. The encoder sets
are loaded once per worker process, so a cache serves every batch and every
unit that process encodes; each worker process has its own.

Entries are one caption's rows of the encoders' outputs (tensors with storage
of their own, no batch dimension, plus flags), exactly as computed: a hit
hands back the bytes a miss would have computed, provided a caption's
encoding does not depend on the other captions encoded with it. It does on
some machines when the batch size changes (benchmarks/README.md, section 12:
CLIP on the CPU with 4 or more threads; GPU kernels choose their algorithm by
the shape), so the encoders always run their text encoders on batches of
exactly ``TEXT_BATCH`` captions, the ones to encode followed by empty
captions (``fill_rows``): every batch has one shape, and a caption's bytes do
not depend on the cache, the batch size, its companions or its position.

``max_bytes`` bounds the tensors held; 0 turns the cache off (every call
encodes its distinct captions). The counters say how much text-encoder work
was done and saved. A cache that finds its captions do not repeat (fewer than
one in ``REPEAT_RATE`` of the first ``PROBE_CAPTIONS`` asked for came from it)
lets its rows go and stops keeping new ones: a dataset of distinct captions
does not hold up to ``max_bytes`` of embeddings it will never reuse, and the
process's memory stays flat as the dataset grows.

The other encoding processes of a run on the same machine (process-pool
workers, torchrun ranks, the flow's sanity batch) share their rows through a
folder (``share``): the output's working folder, ``.diffprep/text_cache/<the
plan's fingerprint>/<host>/``, one ``torch.save``d row per caption (named by
the caption's sha256, written atomically, read back weights-only; per host, so
that machines sharing a file system never use each other's rows: their kernels
may differ in the last bits). A caption one
process encoded is read there by the others instead of being encoded again; a
process writes at most ``max_bytes`` there. The folder is scratch, never part
of the dataset: a bucket output keeps it in its staging folder, and the run
removes it once its units are done.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from diffprep.writer.shards import atomic_write_bytes

MIB = 1024 * 1024
# Per process. FLUX.1-dev's T5 embedding is [512, 4096] bf16 = 4 MiB a caption, so 4 GiB holds ImageNet-1k's
# 1,000 class captions (the headline use) in bf16, 500 in fp32; smaller encoders' entries are far smaller.
DEFAULT_TEXT_CACHE_MIB = 4096

# Captions per text-encoder forward pass, always (padded with empty captions): the one shape every caption is
# encoded in. A constant, not a setting: the bytes of every dataset depend on it.
TEXT_BATCH = 8

# After this many captions, a cache with fewer hits than one in REPEAT_RATE stops keeping rows (module docstring).
PROBE_CAPTIONS = 256
REPEAT_RATE = 100

Row = tuple[Any, ...]  # one caption's encoding: tensors without a batch dimension, and plain values


@dataclass
class TextCacheStats:
    """What the text encoders did for the captions asked of them since the cache was made."""

    captions: int = 0  # captions asked for (one per sample)
    hits: int = 0  # of those, answered from the cache (this process's, or the run's shared folder)
    shared: int = 0  # distinct captions read from the shared folder: another process had encoded them
    encoded: int = 0  # captions put through the text encoders
    calls: int = 0  # encoder calls that did (one forward pass per text encoder each)
    evicted: int = 0  # entries dropped to stay under the bound
    kept: bool = True  # False once the captions proved not to repeat: nothing is kept from then on

    def to_json(self) -> dict[str, int]:
        return asdict(self)


class TextCache:
    """Caption -> its encoded row, least recently used dropped first once the rows exceed ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no cache), got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = TextCacheStats()
        self._rows: OrderedDict[str, tuple[Row, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.folder: Path | None = None  # shared with the run's other encoding processes on this machine
        self._shared_bytes = 0  # written there by this process

    def share(self, folder: str | Path | None) -> None:
        """Read and write rows in ``folder`` too, for the run's other encoding processes (module docstring);
        None: this process alone. Nothing is shared when the cache is off, or once it stopped keeping rows."""
        self.folder = Path(folder) if folder is not None and self.max_bytes > 0 and self.stats.kept else None

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, captions: Sequence[str], encode: Callable[[list[str]], list[Row]]) -> list[Row]:
        """One row per caption: from the cache, else from ``encode`` (called once, with each missing caption once)."""
        distinct = list(dict.fromkeys(captions))
        found: dict[str, Row] = {}
        with self._lock:
            for caption in distinct:
                entry = self._rows.get(caption)
                if entry is not None:
                    self._rows.move_to_end(caption)
                    found[caption] = entry[0]
        shared = {}
        if self.folder is not None:
            shared = {c: row for c in distinct if c not in found for row in [self._read(c)] if row is not None}
            found.update(shared)
        missing = [caption for caption in distinct if caption not in found]
        if missing:
            computed = encode(missing)
            if len(computed) != len(missing):
                raise RuntimeError(f"the text encoder returned {len(computed)} rows for {len(missing)} captions")
            found.update(zip(missing, computed))
            for caption in missing:
                self._write(caption, found[caption])
        with self._lock:
            self.stats.captions += len(captions)
            self.stats.hits += sum(1 for caption in captions if caption not in missing)
            self.stats.shared += len(shared)
            self.stats.encoded += len(missing)
            self.stats.calls += 1 if missing else 0
            stats = self.stats
            if stats.kept and stats.captions >= PROBE_CAPTIONS and stats.hits * REPEAT_RATE < stats.captions:
                self._stop_keeping()
            for caption in [*shared, *missing]:
                self._keep(caption, found[caption])
        return [found[caption] for caption in captions]

    def _stop_keeping(self) -> None:
        """The captions do not repeat: let every row go, keep none from now on, share none."""
        self.stats.kept = False
        self._rows.clear()
        self.bytes = 0
        self.folder = None

    def _file(self, caption: str) -> Path:
        return self.folder / (hashlib.sha256(caption.encode("utf-8")).hexdigest() + ".pt")

    def _read(self, caption: str) -> Row | None:
        """The row another process wrote for ``caption``; None when there is none (or it cannot be read)."""
        try:
            return tuple(torch.load(io.BytesIO(self._file(caption).read_bytes()), weights_only=True))
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - a damaged file: encode the caption again (and replace it)
            return None

    def _write(self, caption: str, row: Row) -> None:
        """Leave ``row`` for the other processes, while this process's share of the folder stays in bound."""
        size = row_bytes(row)
        if self.folder is None or not self.stats.kept or self._shared_bytes + size > self.max_bytes:
            return
        buffer = io.BytesIO()
        torch.save(row, buffer)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._file(caption), buffer.getvalue())
        except OSError:  # best effort: the folder removed by a run that finished, a full disk; the row is computed
            return
        self._shared_bytes += size

    def _keep(self, caption: str, row: Row) -> None:
        size = row_bytes(row) + len(caption.encode("utf-8"))
        if not self.stats.kept or size > self.max_bytes or caption in self._rows:
            return
        while self._rows and self.bytes + size > self.max_bytes:
            _, (_, dropped) = self._rows.popitem(last=False)
            self.bytes -= dropped
            self.stats.evicted += 1
        self._rows[caption] = (row, size)
        self.bytes += size


def fill_rows(rows: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
    """``rows`` [n, ...] (n <= TEXT_BATCH) followed by copies of ``filler`` [1, ...]: exactly ``TEXT_BATCH`` rows."""
    if not 0 < rows.shape[0] <= TEXT_BATCH:
        raise ValueError(f"fill_rows takes 1 to {TEXT_BATCH} rows, got {rows.shape[0]}")
    return torch.cat([rows, filler.expand(TEXT_BATCH - rows.shape[0], *filler.shape[1:])])


def row_bytes(row: Row) -> int:
    """Bytes of a row's tensors."""
    return sum(value.numel() * value.element_size() for value in row if isinstance(value, torch.Tensor))


def cache_bytes(mib: int | None) -> int:
    """``model.text_cache_mib`` in bytes (None: the default)."""
    return (DEFAULT_TEXT_CACHE_MIB if mib is None else mib) * MIB


__all__ = ["DEFAULT_TEXT_CACHE_MIB", "TEXT_BATCH", "TextCache", "TextCacheStats", "cache_bytes", "fill_rows",
           "row_bytes"]
