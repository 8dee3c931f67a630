"""FastGen's WebDataset loader rules, for the tests that read diffprep's outputs as FastGen would.

Written from ``../shared/reference/consumer-formats.md`` section B (checked against NVlabs/FastGen 34f30e8:
``fastgen/datasets/wds_dataloaders.py``, ``wds_utils.py``), no FastGen code: the ``*.tar`` files of the datatag
folder in integer-stem order; ``ignore_index_paths`` unioned per shard basename, shards not in the folder dropped,
their keys filtered out before anything else (``filter_by_index``); ``filter_items``: every ``key_map`` member
present as raw bytes, then the ``presets_filter`` score filter on the raw ``json`` member (its top-level
``score_key`` below the threshold drops the sample; no json or no such key keeps it); webdataset's ``Decoder`` over
the key map's members only (``.npy`` as a tensor without pickle, ``txt`` stripped, ``.pth`` and ``.json`` through
webdataset's own handlers); ``shard_counts.json`` less each shard's ignored keys (``get_shard_count``).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import webdataset as wds

from diffprep import contract


def _npy(key: str, data: bytes):
    """A FastGen-style ``.npy`` handler: the whole extension, plain arrays only, as a tensor."""
    return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False)) if key.endswith(".npy") else None


def _txt(key: str, data: bytes):
    return data.decode("utf-8").strip() if key.endswith(".txt") else None


def fastgen_shards(out: Path) -> list[str]:
    """The datatag folder's tars, sorted by their integer stems."""
    return [str(p) for p in sorted(Path(out).glob("*.tar"), key=lambda p: int(p.name.split(".")[0]))]


def fastgen_ignore_index(paths: Sequence[str | Path] | None, shards: Sequence[str]) -> dict[str, set[str]]:
    """``{shard basename: keys}`` from the ignore files, unioned, only shards of the dataset kept. A file that does
    not load raises here (34f30e8 logs and skips it; FastGen's newer guide says it raises)."""
    index: dict[str, set[str]] = {}
    for path in paths or ():
        for shard, keys in json.loads(Path(path).read_text()).items():
            index.setdefault(shard, set()).update(keys)
    names = {os.path.basename(s) for s in shards}
    return {shard: keys for shard, keys in index.items() if shard in names}


def fastgen_shard_counts(out: Path, ignore_index: Mapping[str, set[str]]) -> dict[str, int]:
    """``shard_counts.json`` as the deterministic loader uses it: each count less its shard's ignored keys."""
    counts = json.loads((Path(out) / contract.SHARD_COUNTS_JSON).read_text())
    return {name: count - len(ignore_index.get(name, ())) for name, count in counts.items()}


def _score_filter(item: dict, threshold: float = 5.0, score_key: str = "score") -> bool:
    if "json" not in item:
        return True
    data = json.loads(item["json"])
    return not (score_key in data and data[score_key] < threshold)


PRESET_FILTERS = {"score": _score_filter}


def fastgen_samples(out, key_map: Mapping[str, str], *, presets_filter: Mapping[str, Mapping] | None = None,
                    ignore_index_paths: Sequence[str | Path] | None = None) -> list[dict]:
    """Every sample FastGen's ``WDSLoader`` would hand on, in order, as webdataset items: the key map's members
    decoded (``.pth`` through webdataset's own handler), the others left as bytes; ``__url__`` names its shard."""
    shards = fastgen_shards(out)
    ignore = fastgen_ignore_index(ignore_index_paths, shards)
    filters = [lambda item, f=PRESET_FILTERS[name], kw=dict(kwargs): f(item, **kw)
               for name, kwargs in (presets_filter or {}).items()]

    def keep(item: dict) -> bool:
        if item["__key__"] in ignore.get(os.path.basename(item["__url__"]), ()):
            return False
        if not all(isinstance(item.get(member), (bytes, bytearray)) for member in key_map.values()):
            return False
        return all(f(item) for f in filters)

    decoder = wds.autodecode.Decoder([_npy, _txt], only=list(key_map.values()))
    return list(wds.WebDataset(shards, shardshuffle=False, empty_check=False).select(keep).map(decoder))
