"""What a finalized dataset declares, read once into an immutable ``Dataset`` the checks look at.

``read_dataset`` reads ``dataset.yaml``, ``.info.json``, ``split.yaml``,
``index.sqlite``, the unit manifests (one at a time: the description keeps
each shard's count and reads a manifest again when a check asks for it), the
recorded splits and the expected shapes (the argument, else plan.json), and
returns the description with the metadata check: what could not be read is a
finding, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.run.energon import read_assignment, read_split_yaml
from diffprep.run.manifests import Manifests
from diffprep.errors import ConfigError, DatasetValidationError
from diffprep.writer.layouts import Layout
from diffprep.output import Output
from diffprep.writer.shards import UnitManifest

TENSOR_NAMES = tuple(contract.field_stem(name) for name in
                     contract.TENSOR_FIELDS + contract.POSTERIOR_FIELDS + contract.LTX2_TENSOR_FIELDS
                     + (contract.SCENE_C2W, contract.SCENE_K, contract.DEPTH_LATENT))
# plan.json's "expected": a shape per tensor (None for a free dimension), the dtype, and optionally
# "fields", the fields every sample must have (how a raw plan names its image and caption fields), for a
# video plan "buckets", the latents' shape per resolution bucket ("WxHxF"), and where tensors differ in dtype
# (LTX-2) "dtypes", one per tensor; a raw scene plan's "scene": its frames per scene, stored size and depth.
# "audio": a raw clip plan that keeps each clip's sound ({"codec": ..., "channels": ...}).
EXPECTED_KEYS = (*TENSOR_NAMES, "dtype", "dtypes", "fields", "buckets", "audio", "scene")
TENSOR_FIELD_STEMS = tuple(contract.field_stem(name) for name in contract.TENSOR_FIELDS)  # always in a plan


@dataclass(frozen=True)
class Dataset:
    """A dataset as its metadata and state describe it (None: could not be read; see the metadata check)."""

    uri: str
    encoding: str | None
    info: dict[str, int] | None  # shard -> samples, from .info.json
    split_of: dict[str, str] | None  # shard -> split, from split.yaml
    # unit -> manifest, each read when it is asked for (``ReadManifests``: at 100k units, never all at once)
    manifests: Mapping[int, UnitManifest] = field(default_factory=dict)
    expected: dict[str, Any] | None = None
    recorded_splits: dict[str, str] | None = None  # shard -> split, from .diffprep/splits.json
    recorded_splits_problem: str | None = None
    layout: Layout = field(default_factory=Layout)  # the member names, from dataset.yaml's subflavors
    committed: dict[str, int] = field(default_factory=dict)  # shard -> samples, of every manifest naming a shard
    layout_subflavors: dict[str, Any] | None = None  # dataset.yaml's subflavors, as Energon hands them to cookers


class ReadManifests(Manifests):
    """The unit manifests read one at a time; one that cannot be read is left out and named in ``problems``
    (validation reports it under the manifests check instead of stopping)."""

    def __init__(self, output: Output) -> None:
        super().__init__(output)
        self.problems: dict[int, str] = {}

    def __getitem__(self, unit: int) -> UnitManifest:
        try:
            return super().__getitem__(unit)
        except (OSError, ValueError, TypeError) as error:
            self.problems[unit] = (f"cannot read the manifest of unit {unit} in {contract.STATE_DIR}/"
                                   f"{contract.UNITS_DIR}: {type(error).__name__}: {error}")
            raise KeyError(unit) from None

    def items(self) -> Iterator[tuple[int, UnitManifest]]:  # type: ignore[override]
        """(unit, manifest) in unit order, one read at a time, without those that cannot be read."""
        for unit in self:
            manifest = self.get(unit)
            if manifest is not None:
                yield unit, manifest

    def values(self) -> Iterator[UnitManifest]:  # type: ignore[override]
        return (manifest for _, manifest in self.items())


def normalize_expected(expected: dict[str, Any], where: str) -> dict[str, Any]:
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
    dtypes = expected.get("dtypes")
    if dtypes is not None:
        if not (isinstance(dtypes, dict) and all(isinstance(getattr(torch, str(d), None), torch.dtype)
                                                 for d in dtypes.values())):
            raise ConfigError(f"expected dtypes from {where} must map tensor names to torch dtype names, "
                              f"got {dtypes!r}")
        result["dtypes"] = dict(dtypes)
    buckets = expected.get("buckets")
    if buckets is not None:
        valid = isinstance(buckets, dict) and all(
            isinstance(shape, list) and all(isinstance(d, int) for d in shape) for shape in buckets.values())
        if not valid:
            raise ConfigError(f"expected buckets from {where} must map 'WxHxF' to a latents shape, got {buckets!r}")
        result["buckets"] = {name: list(shape) for name, shape in buckets.items()}
    audio = expected.get("audio")
    if audio is not None:
        if not (isinstance(audio, dict) and isinstance(audio.get("codec"), str)
                and isinstance(audio.get("channels"), int)):
            raise ConfigError(f"expected audio from {where} must be {{'codec': name, 'channels': n}}, got {audio!r}")
        result["audio"] = dict(audio)
    if isinstance(expected.get("scene"), dict):
        result["scene"] = dict(expected["scene"])
    for name in TENSOR_NAMES:
        shape = expected.get(name)
        valid = isinstance(shape, (list, tuple)) and all(d is None or isinstance(d, int) for d in shape)
        if shape is not None and not valid:
            raise ConfigError(f"expected {name} from {where} must be a list of ints (None for any size), got {shape!r}")
        if shape is not None:
            result[name] = list(shape)
        elif name in TENSOR_FIELD_STEMS:
            result[name] = None
    if result["latents"] is None:
        result["latents"] = [None, None, None]
    return result


def read_dataset(output: Output, encoding: str | None, expected: dict[str, Any] | None) -> tuple[Dataset, Check]:
    """The dataset's description and the metadata check (files present, parsed and consistent).

    ``expected``: already normalized (``normalize_expected``); None: plan.json's.
    """
    problems = Findings("metadata")
    out = output.working_copy()  # a bucket prefix's metadata and state, staged
    meta = out / contract.NV_META
    found_encoding = None
    layout = Layout()
    subflavors_found = None
    dataset_yaml = meta / contract.DATASET_YAML
    try:
        config = yaml.safe_load(dataset_yaml.read_text(encoding="utf-8"))
        if not isinstance(config, dict) or config.get("__class__") != "CrudeWebdataset":
            problems.add(f"{dataset_yaml} does not declare a CrudeWebdataset: {config!r}")
        else:
            subflavors = config.get("subflavors")
            subflavors_found = subflavors if isinstance(subflavors, dict) else None
            declared = subflavors.get("encoding") if isinstance(subflavors, dict) else None
            if declared not in contract.ENCODINGS:
                problems.add(f"{dataset_yaml} has subflavors.encoding {declared!r}, "
                             f"expected one of {list(contract.ENCODINGS)}")
            elif encoding is not None and declared != encoding:
                problems.add(f"{dataset_yaml} declares encoding {declared!r}, validation asked for {encoding!r}")
            else:
                found_encoding = declared
            try:
                layout = Layout.of_subflavors(subflavors if isinstance(subflavors, dict) else None)
            except (KeyError, TypeError, AttributeError) as error:
                problems.add(f"{dataset_yaml} has an unreadable subflavors.layout ({type(error).__name__}: {error}); "
                             "run finalize")
    except (OSError, yaml.YAMLError) as error:
        problems.add(f"{dataset_yaml}: {error}; run finalize")

    info = None
    info_json = meta / contract.INFO_JSON
    try:
        counts = json.loads(info_json.read_text(encoding="utf-8"))["shard_counts"]
        if not isinstance(counts, dict) or not all(isinstance(v, int) and v > 0 for v in counts.values()):
            problems.add(f"{info_json} shard_counts must map shard names to positive counts")
        else:
            info = counts
    except (OSError, ValueError, KeyError) as error:
        problems.add(f"{info_json}: {type(error).__name__}: {error}; run finalize")

    split_of = None
    try:
        if not (meta / contract.SPLIT_YAML).is_file():
            raise FileNotFoundError(f"{meta / contract.SPLIT_YAML} is missing; run finalize")
        split_of = read_split_yaml(out)
        unknown = sorted(set(split_of.values()) - set(contract.SPLITS))
        if unknown:
            problems.add(f"{meta / contract.SPLIT_YAML} has splits {unknown}; "
                         f"diffprep writes only {list(contract.SPLITS)}")
        if "train" not in split_of.values():
            problems.add(f"{meta / contract.SPLIT_YAML} has no train shards")
    except (OSError, yaml.YAMLError, DatasetValidationError) as error:
        problems.add(str(error))
        split_of = None

    index = meta / contract.INDEX_SQLITE
    if not index.is_file():
        problems.add(f"{index} is missing; run finalize")
    else:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
                indexed = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
            if info is not None and indexed != sum(info.values()):
                problems.add(f"{index} holds {indexed} samples, {contract.INFO_JSON} counts {sum(info.values())}; "
                             "run finalize again")
        except sqlite3.Error as error:
            problems.add(f"{index}: {error}")

    manifests: Mapping[int, UnitManifest] = {}
    committed: dict[str, int] = {}
    try:
        manifests = ReadManifests(output)
        # One pass, one manifest at a time: what the split and foreign-file checks need of each (a name and a count).
        committed = {m.shard: m.count for m in manifests.values() if m.has_shard}
    except (OSError, ValueError) as error:
        problems.add(f"cannot read the unit manifests in {contract.STATE_DIR}/{contract.UNITS_DIR}: "
                     f"{type(error).__name__}: {error}")

    if expected is None:
        plan = output.state.local_copy(contract.PLAN_JSON)
        if plan is not None:
            try:
                planned = json.loads(plan.read_text(encoding="utf-8"))
                planned = planned.get("expected") if isinstance(planned, dict) else None
                if planned:
                    expected = normalize_expected(planned, str(plan)) | {"source": "plan"}
            except (ValueError, ConfigError) as error:
                problems.add(f"{plan}: {error}")

    recorded, recorded_problem = None, None
    if output.state.exists(contract.SPLITS_JSON):
        try:
            recorded = read_assignment(output)
        except (OSError, ValueError, KeyError, TypeError) as error:
            recorded_problem = f"{output.state.path(contract.SPLITS_JSON)}: {type(error).__name__}: {error}"

    dataset = Dataset(output.uri, found_encoding, info, split_of, manifests, expected, recorded, recorded_problem,
                      layout, committed, subflavors_found)
    return dataset, problems.check("dataset.yaml, split.yaml, .info.json, index.sqlite present and consistent")


__all__ = ["Dataset", "ReadManifests", "normalize_expected", "read_dataset"]
