"""Datasets encoded elsewhere and ingested as stored: MLPerf Flux's Arrow rows as Primus's ``preencoded_numpy``.

Nothing is encoded: each row of an Arrow file becomes one sample whose members
are the row's bytes unchanged (``t5.bytes``, ``clip.bytes``, ``mean.bytes``,
``logvar.bytes``: ``.npy`` files of uint16 words that are bfloat16 values)
plus a ``json`` record of where it came from (``key``: the row's ``__key__``,
or the diffprep key; ``source_id``: ``<file>#<row>``). A unit is one file of
the manifest; its rows are only known once it is read, so the audit accounts
for ``<file>#0`` .. ``#n-1`` of the n rows the manifest records.

A row is a reject, never an error, when a column is missing or null or is not
a uint16 ``.npy``. The writing itself (downloads, units, the run) is
``diffprep.tools.ingest``; this module says what a sample holds and how it is
checked, loaded and judged.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings, shape_str
from diffprep.config import Settings
from diffprep.encodings.base import Encoding, SampleFields
from diffprep.errors import ConfigError
from diffprep.writer.plan import Plan, UnitPlan, shape_matches
from diffprep.writer.shards import Reject, UnitManifest

FORMAT_MLPERF = "mlperf-flux-arrow"
# Arrow column -> sample field, in contract order.
COLUMN_FIELDS = dict(zip(contract.MLPERF_COLUMNS, contract.INGESTED_FIELDS[:4]))
ROW_SEPARATOR = "#"
STORED_DTYPE = "uint16"  # bfloat16 words, as MLPerf saves them
LOADED_DTYPE = "bfloat16"


def row_id(file_name: str, row: int) -> str:
    """A row's source id: ``<file>#<row>``."""
    return f"{file_name}{ROW_SEPARATOR}{row}"


def npy_header(data: bytes) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an ``.npy`` file declares (its header only; no pickle, nothing else read)."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    if dtype.hasobject:
        raise ValueError("the array holds Python objects (a pickle)")
    if len(data) - stream.tell() != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"{len(data) - stream.tell()} data bytes for shape {list(shape)} of {dtype}")
    return tuple(shape), dtype


def row_fields(row: Mapping[str, Any], source_id: str, key: str) -> dict[str, Any] | Reject:
    """A row's sample fields (its bytes unchanged), or the reject that says what is wrong with it."""
    fields: dict[str, Any] = {}
    for column, field in COLUMN_FIELDS.items():
        data = row.get(column)
        if data is None:
            return Reject(source_id, "missing_column", f"the row has no {column} value", phase="read")
        if not isinstance(data, bytes):
            return Reject(source_id, "bad_column", f"{column} holds {type(data).__name__}, not binary", phase="read")
        try:
            _shape, dtype = npy_header(data)
        except ValueError as error:
            return Reject(source_id, "bad_npy", f"{column} is not a plain .npy file: {error}", phase="read")
        if dtype.kind != "u" or dtype.itemsize != 2:
            return Reject(source_id, "bad_dtype", f"{column} is {dtype}, not uint16 words of bfloat16 values",
                          phase="read")
        fields[field] = data
    stored_key = row.get(contract.MLPERF_KEY_COLUMN)
    fields[contract.INGESTED_META] = {"key": str(stored_key) if stored_key is not None else key,
                                      "source_id": source_id}
    return fields


def shapes_of(fields: Mapping[str, bytes]) -> dict[str, list[int]]:
    """Each tensor field's stored shape, by its stem (``t5``, ``clip``, ``mean``, ``logvar``)."""
    return {contract.field_stem(f): list(npy_header(fields[f])[0]) for f in contract.INGESTED_FIELDS[:4]}


class Ingested(Encoding):
    """Samples encoded elsewhere (MLPerf Flux: T5, CLIP, the VAE posterior's mean and logvar), stored as they came."""

    name = contract.ENCODING_PREENCODED_NUMPY
    layout_presets = None  # Primus reads these member names; no other layout

    def ingest_settings(self, source_format: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(byte settings, expected) of an ingest of ``source_format``: the shapes are the first sample's."""
        byte = {"contract": contract.CONTRACT_VERSION, "encoding": self.name, "format": source_format,
                "columns": dict(COLUMN_FIELDS), "unit": "one source file"}
        expected = {"fields": list(contract.INGESTED_FIELDS), "dtype": LOADED_DTYPE}
        return byte, expected

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.ingest_settings(FORMAT_MLPERF)

    def planned(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.plan_settings(settings, token)

    def planned_ids(self, unit: UnitPlan, manifest: UnitManifest) -> list[str]:
        """A unit is one file: every one of the rows it held, ``<file>#0`` .. ``#n-1``."""
        return [row_id(name, row) for name in unit.source_ids for row in range(manifest.inputs)]

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return contract.INGESTED_FIELDS

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        missing = [f for f in contract.INGESTED_FIELDS if f not in fields]
        return problem or (f"missing {missing}" if missing else "")

    def _ingested_only(self, what: str):
        return ConfigError(f"{what}: a {self.name} dataset is not encoded by diffprep; `diffprep ingest` writes it")

    def load(self, settings: Settings, token: str | None) -> None:
        return None

    def sample_fields(self, settings: Settings, loaded: Any) -> SampleFields:
        raise self._ingested_only("sample fields of a batch")

    def batch_size(self, settings: Settings) -> int:
        return 1

    def sanity(self, output, plan, loaded, source, spec, **options):
        raise self._ingested_only("the encode sanity check")  # diffprep.tools.ingest checks the first file's rows

    def oom_advice(self, settings: Settings, loaded: Any) -> str:
        return "nothing is encoded on a device here: free host memory"

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.T5_BYTES in fields and contract.MEAN_BYTES in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any):
        raise ConfigError("this dataset was encoded elsewhere and ingested as stored (MLPerf Flux's VAE posterior "
                          "mean and logvar as bfloat16 .npy): it names no VAE that diffprep could decode pictures "
                          "with; its samples load with diffprep.writer.cooker.NumpyPreencodedTaskEncoder")

    def task_encoder(self) -> Any:
        from diffprep.writer.cooker import NumpyPreencodedTaskEncoder  # Energon: finalize and validation only

        return NumpyPreencodedTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> "IngestedInspector":
        return IngestedInspector(expected)


class IngestedInspector:
    """Validation of loaded ingested samples: bfloat16, one shape per field across the dataset (the plan's, else the
    first sample's), mean and logvar alike, finite values; per-channel statistics of the posterior mean."""

    TENSORS = ("prompt_embeds", "pooled_prompt_embeds", "mean", "logvar")

    def __init__(self, expected: dict[str, Any] | None) -> None:
        from diffprep.report.latent_stats import LatentStats

        self.expected = dict(expected or {})
        self.shapes = Findings("shapes and dtypes")
        self.finite = Findings("finite values")
        # field -> {"shapes": {shape: samples}, "dtypes": {dtype: samples}}: every inspector's summary shape, which
        # the report and the run summary read
        self.fields: dict[str, dict[str, dict[str, int]]] = {}
        self.stats = LatentStats()

    def inspect(self, sample: Any) -> None:
        tensors = {name: getattr(sample, name) for name in self.TENSORS}
        for name, tensor in tensors.items():
            shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
            seen = self.fields.setdefault(name, {"shapes": {}, "dtypes": {}})
            seen["shapes"][shape_str(shape)] = seen["shapes"].get(shape_str(shape), 0) + 1
            seen["dtypes"][dtype] = seen["dtypes"].get(dtype, 0) + 1
            want = self.expected.setdefault(name, shape)
            if not shape_matches(shape, want):
                self.shapes.add(f"{sample.__key__} {name} has shape {shape}, the dataset's is {want}")
            if dtype != LOADED_DTYPE:
                self.shapes.add(f"{sample.__key__} {name} is {tensor.dtype}, expected {LOADED_DTYPE}")
            if not bool(torch.isfinite(tensor).all()):
                self.finite.add(f"{sample.__key__} {name} has {int((~torch.isfinite(tensor)).sum())} NaN/Inf values")
        if list(tensors["mean"].shape) != list(tensors["logvar"].shape):
            self.shapes.add(f"{sample.__key__} mean {list(tensors['mean'].shape)} and logvar "
                            f"{list(tensors['logvar'].shape)} differ")
        if tensors["mean"].ndim >= 3:
            self.stats.add(tensors["mean"])

    def checks(self) -> list[Check]:
        return [self.shapes.check("bfloat16, one shape per field"), self.finite.check("no NaN or Inf")]

    def summary(self) -> dict[str, Any]:
        return {"fields": self.fields}

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        from diffprep.writer.shards import torch_bytes

        if not self.stats.samples:
            return [], {}, {}
        stats = self.stats.result()
        summary = {"latent_stats": {"of": "mean", "mean": [float(v) for v in stats["mean"]],
                                    "std": [float(v) for v in stats["std"]], "count": self.stats.count,
                                    "samples": self.stats.samples}}
        check = Check("latent stats", True, f"per-channel mean/std of the posterior mean over {self.stats.samples} "
                                            f"samples saved to {contract.STATE_DIR}/{contract.LATENT_STATS}")
        return [check], summary, {contract.LATENT_STATS: torch_bytes(stats)}


__all__ = ["FORMAT_MLPERF", "Ingested", "IngestedInspector", "npy_header", "row_fields", "row_id",
           "shapes_of"]
