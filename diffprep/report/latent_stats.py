"""Latent statistics: per-channel mean and std, and the full channel covariance with its whitening, for training.

Every latent value of a channel is one observation: a latent ``[C, ...]``
(an image's ``[C, H, W]``, a clip's ``[C, F, H, W]``, LTX-2 audio's
``[C, T, F]``) adds ``prod(...)`` observations of a ``C``-vector. Moments are
kept in float64 and merged per sample with Chan et al.'s pairwise update (the
mean, the per-channel sum of squared deviations and, with ``full_cov``, the
matrix of co-deviations), so any split of the samples into units, workers or
runs merges to the same statistics up to float64 rounding.

The result is the dict GAE's trainer loads (reference/scenes-and-cameras.md):
``mean`` (C,), ``std`` (C,, population), ``count`` (observations per channel)
and ``samples``; with the full covariance also ``cov`` (C, C, population),
``whiten`` = cov^-1/2 and ``unwhiten`` = cov^1/2 (ZCA: the symmetric
eigendecomposition, eigenvalues floored at 1e-8) and ``condition`` (the
largest eigenvalue over the smallest, after the floor). Computed in float64,
saved as float32, the dtype of GAE's file: cast to the training dtype where it
is applied (``(z - mean) / std``, or ``whiten @ (z - mean)`` over the channel
axis). The moments that units, workers and runs merge stay float64.

``dataset_stats`` reads every committed sample of a finished dataset (shards,
local or in a bucket, under any layout; or the LTX trainer's record folders)
without re-encoding: ``diffprep latent-stats OUT``.

A latent field is read through ``LATENT_READERS`` (field -> how its stored
value becomes the latent tensor), both while a unit writes it and when its
shard is read back, so no module here asks what kind of dataset it has: a
tensor is taken as it is; the sd-vae edm-zip archive's ``mean_std.npy`` (the
SD VAE posterior, mean and std concatenated on the channels) by its mean half,
the dict marked ``"of": "mean"``. Its std is left out on purpose: FastGen's
ImageNet-256 training draws ``mean + std * eps`` itself and scales that by the
VAE's scaling factor, so what a trainer normalizes with are the statistics of
the latents' centre, not of the stored concatenation (whose second half is a
positive spread, not a latent).

Every unit accumulates these moments while it encodes (``UnitStats``: per
latent field, float64; the co-moments only with ``--full-cov``) and saves them
beside its manifest, before the commit (``.diffprep/unit_stats/NNNNNN.pt``);
``merged_unit_stats`` folds the committed units' into the dataset's at
finalize, in unit order, so no second pass over the data is needed and the
file's bytes do not depend on how the units were shared among workers, ranks or
runs. A committed unit without its file (encoded by an earlier diffprep), or
without the co-moments when another unit has them, is read from its shard
instead, so a resumed or appended run still merges every sample.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from diffprep import contract
from diffprep.writer.layouts import Layout
from diffprep.writer.shards import SampleLoadError, load_tensor

EIGEN_FLOOR = 1e-8


def _tensor(value: Any, key: str, field: str) -> torch.Tensor:
    """A latent tensor as written, or its ``torch.save``d bytes (weights only)."""
    return value if isinstance(value, torch.Tensor) else load_tensor(value, key=key, field=field)


def _posterior_mean(value: Any, key: str, field: str) -> torch.Tensor:
    """An SD VAE posterior ``.npy`` (bytes, or the array read from them), ``[2C, ...]`` = mean then std: its mean
    half, float32 as stored."""
    try:
        array = value if isinstance(value, np.ndarray) else np.load(io.BytesIO(value), allow_pickle=False)
    except Exception as error:  # any failure to parse is this sample's, named
        raise SampleLoadError(f"sample {key!r} field {field!r} is not a readable .npy file: {error}") from error
    if array.ndim < 2 or array.shape[0] % 2 or not np.issubdtype(array.dtype, np.floating):
        raise SampleLoadError(f"sample {key!r} field {field!r} holds {array.dtype} {list(array.shape)}, expected "
                              "a float posterior [2C, ...]: C mean channels, then C std channels")
    return torch.from_numpy(array[: array.shape[0] // 2].copy())  # a copy: np.load of bytes is read-only


def _ingested_mean(value: Any, key: str, field: str) -> torch.Tensor:
    """An ingested dataset's posterior mean (MLPerf Flux's bfloat16 words as ``.npy``, ``[C, ...]``), as the
    trainer that resamples from it reads it (``diffprep.writer.cooker.load_bf16_npy``)."""
    if isinstance(value, torch.Tensor):
        return value
    from diffprep.writer.cooker import load_bf16_npy  # here: Energon, which the cookers import, only for this field

    return load_bf16_npy(value, key=key, field=field)


@dataclass(frozen=True)
class LatentField:
    """How a sample field holds latents: ``read(value, key, field)`` gives the tensor ``[C, ...]`` the statistics
    are of (from what a writer produced or its stored bytes); ``top``: its statistics are the dict's top level (the
    dataset's latents, as GAE's trainer loads them), else under the field's stem; ``of``: the part of the stored
    value they describe, recorded in the dict as ``"of"`` (None: all of it)."""

    read: Callable[[Any, str, str], torch.Tensor]
    top: bool = False
    of: str | None = None


# The latent fields of a sample that get statistics (in the Energon layout's names), in the order they are kept,
# and the LTX trainer's folders that hold them.
LATENT_READERS = {
    contract.LATENTS: LatentField(_tensor, top=True),
    contract.AUDIO_LATENTS: LatentField(_tensor),
    contract.SD_VAE_POSTERIOR: LatentField(_posterior_mean, top=True, of="mean"),
    contract.MEAN_BYTES: LatentField(_ingested_mean, top=True, of="mean"),  # an ingested VAE posterior's mean
}
LATENT_FIELDS = tuple(LATENT_READERS)
RECORD_FOLDERS = {contract.LATENTS: contract.LATENTS_DIR, contract.AUDIO_LATENTS: contract.AUDIO_LATENTS_DIR}


def latent_of(field: str, value: Any, key: str = "?") -> torch.Tensor:
    """``field``'s latent tensor from a sample's value for it (``LATENT_READERS``)."""
    return LATENT_READERS[field].read(value, key, field)


class LatentStats:
    """Per-channel mean and variance (and, with ``full_cov``, the covariance) over all latent values, merged per
    sample in float64 (Chan et al.)."""

    def __init__(self, full_cov: bool = False) -> None:
        self.full_cov = full_cov
        self.count = 0
        self.samples = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None
        self.comoment: torch.Tensor | None = None  # sum of (x - mean)(x - mean)^T, with full_cov

    def add(self, latents: torch.Tensor) -> None:
        # A fresh contiguous copy first: a sample's view into its batch (other strides, another alignment) would
        # sum in another order than the stored tensor, and the moments must be the stored latents' to the bit.
        values = latents.detach().to("cpu").contiguous().clone().to(torch.float64).reshape(latents.shape[0], -1)
        n = values.shape[1]
        mean = values.mean(dim=1)
        centered = values - mean[:, None]
        m2 = (centered**2).sum(dim=1)
        comoment = centered @ centered.T if self.full_cov else None
        self._merge(n, mean, m2, comoment)
        self.samples += 1

    def merge(self, other: LatentStats) -> None:
        """Fold ``other`` (statistics of other samples, e.g. another unit's) into these."""
        if other.mean is None:
            return
        self._merge(other.count, other.mean, other.m2, other.comoment if self.full_cov else None)
        self.samples += other.samples

    def _merge(self, n: int, mean: torch.Tensor, m2: torch.Tensor, comoment: torch.Tensor | None) -> None:
        if self.mean is None:
            self.count, self.mean, self.m2, self.comoment = n, mean, m2, comoment
            return
        if mean.shape != self.mean.shape:
            raise ValueError(f"latents with {mean.shape[0]} channels cannot join statistics of {self.mean.shape[0]}")
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        if self.full_cov:
            if comoment is None or self.comoment is None:
                raise ValueError("full covariance needs the co-moments of every part")
            self.comoment = self.comoment + comoment + torch.outer(delta, delta) * (self.count * n / total)
        self.count = total

    def to_state(self) -> dict[str, Any]:
        """The moments as saved (tensors and numbers only: loadable with weights_only)."""
        state: dict[str, Any] = {"count": torch.tensor(self.count), "samples": torch.tensor(self.samples),
                                 "mean": self.mean, "m2": self.m2}
        if self.full_cov:
            state["comoment"] = self.comoment
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], full_cov: bool | None = None) -> LatentStats:
        """The saved moments; ``full_cov=False`` leaves out the co-moments they may hold."""
        stats = cls(full_cov="comoment" in state if full_cov is None else full_cov)
        stats.count, stats.samples = int(state["count"]), int(state["samples"])
        stats.mean, stats.m2 = state["mean"], state["m2"]
        stats.comoment = state.get("comoment") if stats.full_cov else None
        return stats

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The statistics, computed in float64 and their float tensors cast to ``dtype`` (float32: the dtype of the
        file GAE's trainer loads); ``count`` and ``samples`` stay int64."""
        assert self.mean is not None and self.m2 is not None
        stats = {
            "mean": self.mean.clone(),
            "std": (self.m2 / self.count).sqrt(),  # population std over every latent value of the channel
            "count": torch.tensor(self.count, dtype=torch.int64),
            "samples": torch.tensor(self.samples, dtype=torch.int64),
        }
        if self.full_cov and self.comoment is not None:
            cov = self.comoment / self.count
            cov = (cov + cov.T) / 2  # exactly symmetric for the eigendecomposition
            eigenvalues, vectors = torch.linalg.eigh(cov)
            floored = eigenvalues.clamp_min(EIGEN_FLOOR)
            stats |= {
                "cov": cov,
                "whiten": (vectors * floored.rsqrt()) @ vectors.T,
                "unwhiten": (vectors * floored.sqrt()) @ vectors.T,
                "condition": floored.max() / floored.min(),
            }
        return {name: value.to(dtype) if value.is_floating_point() else value for name, value in stats.items()}


class UnitStats:
    """One unit's moments per latent field, accumulated as its samples are written (the co-moments with
    ``full_cov``)."""

    def __init__(self, full_cov: bool = False) -> None:
        self.full_cov = full_cov
        self.fields: dict[str, LatentStats] = {}

    def add(self, fields: Any) -> None:
        """A written sample's fields (diffprep's names, before the layout renames them), each latent field read as
        its shard is read back (``LATENT_READERS``): the moments are the stored latents', to the bit."""
        for name in LATENT_FIELDS:
            value = fields.get(name)
            if value is not None:
                self.fields.setdefault(name, LatentStats(self.full_cov)).add(latent_of(name, value).detach().cpu())

    def to_bytes(self, fingerprint: str) -> bytes:
        from diffprep.writer.shards import torch_bytes

        return torch_bytes({"fingerprint": fingerprint,
                            "fields": {name: stats.to_state() for name, stats in sorted(self.fields.items())}})


def unit_stats_path(unit: int) -> str:
    """A unit's moments, inside the state folder."""
    return f"{contract.UNIT_STATS_DIR}/{unit:06d}.pt"


def merged_unit_stats(output: Any, plan: Any) -> dict[str, Any] | None:
    """The dataset's statistics (``dataset_stats``'s dict) from its committed units' saved moments, merged in unit
    order; with the full covariance when any unit saved co-moments (``--full-cov``). A unit without them is read
    from its shard. None when no unit saved any (a dataset of an earlier diffprep, or without latents).

    Two passes over the units, each holding one manifest and one unit's moments at a time (at 100k units neither
    every manifest nor every unit's co-moments fit in memory): the first learns which units saved moments and
    whether any saved co-moments, the second merges them in unit order."""
    units = _committed_units(output, plan)
    saved: set[int] = set()
    full_cov = False
    for unit in units:
        fields = _saved_moments(output, plan, unit)
        if fields is not None:
            saved.add(unit)
            full_cov = full_cov or any("comoment" in state for state in fields.values())
    if not saved:
        return None

    def parts() -> Iterator[tuple[Any, dict[str, LatentStats]]]:
        for unit in units:
            manifest = output.state.manifest(unit)
            fields = _saved_moments(output, plan, unit) if unit in saved else None
            if fields is not None and (not full_cov or all("comoment" in state for state in fields.values())):
                yield manifest, {name: LatentStats.from_state(state, full_cov) for name, state in fields.items()}
            else:  # saved by an earlier diffprep, or without the co-moments: its shard read now
                yield manifest, unit_moments(output, plan, manifest, full_cov)

    return merge_units(plan, parts())


def _committed_manifests(output: Any, plan: Any) -> Iterator[Any]:
    """The manifests of ``plan``'s fingerprint in unit order, each read once, one at a time."""
    for unit in sorted(output.state.manifest_units()):
        manifest = output.state.manifest(unit)
        if manifest is not None and manifest.fingerprint == plan.fingerprint:
            yield manifest


def _committed_units(output: Any, plan: Any) -> list[int]:
    """``_committed_manifests``' unit numbers (each manifest looked at and dropped)."""
    return [manifest.unit for manifest in _committed_manifests(output, plan)]


def _saved_moments(output: Any, plan: Any, unit: int) -> dict[str, Any] | None:
    """The moments a unit saved while it encoded (field -> state), None where it saved none for this plan."""
    data = output.state.read_bytes(unit_stats_path(unit))
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True) if data else None
    if isinstance(state, dict) and state.get("fingerprint") == plan.fingerprint:
        return state["fields"]
    return None


def unit_moments(output: Any, plan: Any, manifest: Any, full_cov: bool) -> dict[str, LatentStats]:
    """One committed unit's moments per latent field, from its stored latents in key order: what the unit saved
    while it encoded, to the bit."""
    fields: dict[str, LatentStats] = {}
    for _key, _bucket, tensors in stored_latents(output, plan, [manifest]):
        for name, tensor in tensors.items():
            fields.setdefault(name, LatentStats(full_cov)).add(tensor)
    return fields


def merge_units(plan: Any, parts: Iterable[tuple[Any, dict[str, LatentStats]]]) -> dict[str, Any] | None:
    """Units' moments (manifest, field -> moments) merged in the given order (unit order: the same bytes however
    the units were shared out), per bucket too where the dataset has several."""
    totals: dict[str, LatentStats] = {}
    per_bucket: dict[str, dict[str, LatentStats]] = {}
    for manifest, fields in parts:
        bucket = plan.unit(manifest.unit).bucket
        for name, stats in sorted(fields.items()):
            totals.setdefault(name, LatentStats(stats.full_cov)).merge(stats)
            if bucket is not None:
                per_bucket.setdefault(bucket, {}).setdefault(name, LatentStats(stats.full_cov)).merge(stats)
    return _arrange(totals, per_bucket if len(per_bucket) > 1 else {}) if totals else None


def finalized_stats(output: Any, plan: Any, validated: bytes | None = None
                    ) -> tuple[list[Any], dict[str, Any], dict[str, bytes]]:
    """What finalize's validation adds for the statistics: (checks, summary, state files). The units' merged
    moments as ``latent_stats.pt``; when ``validated`` (validation's own statistics over every stored latent) is
    given, their mean and std must be its (a mismatch fails, and nothing is written). With the full covariance a
    check and the summary line ``latent_stats_full``; per channel nothing more (the validation report stays as
    without the units' moments). Nothing when no unit saved moments."""
    from diffprep.report.checks import Check
    from diffprep.writer.shards import torch_bytes

    merged = merged_unit_stats(output, plan)
    if not merged:
        return [], {}, {}
    checks = []
    line = summary(merged)
    if validated is not None and "mean" in merged:
        seen = torch.load(io.BytesIO(validated), map_location="cpu", weights_only=True)
        if not same_stats(merged, seen):
            return [Check("latent stats from the units", False, "the units' merged mean/std differ from those of "
                          "the stored latents: a unit's moments do not match its shard; run `diffprep latent-stats "
                          "OUT` to recompute them")], {}, {}
    if "cov" in merged:
        checks.append(Check("latent stats from the units", True, (
            f"the units' merged moments ({line['samples']} samples, condition number {line['condition']:.3g})"
            + (" give the mean and std of every stored latent" if validated is not None else "")
            + f"; saved with the full covariance to {contract.STATE_DIR}/{contract.LATENT_STATS}")))
        return checks, {"latent_stats_full": line}, {contract.LATENT_STATS: torch_bytes(merged)}
    return checks, {}, {contract.LATENT_STATS: torch_bytes(merged)}


def stored_latents(output: Any, plan: Any, manifests: Iterable[Any] | None = None
                   ) -> Iterator[tuple[str, str | None, dict[str, torch.Tensor]]]:
    """Every committed sample's latent tensors (of ``manifests``, default every committed unit's), as (key,
    bucket, field -> tensor), in unit and key order: read from its shard under the plan's layout (loaded weights
    only), or from the LTX trainer's records."""
    from diffprep.families.ltx2_precomputed import is_ltx, load_record, sample_names

    if manifests is None:
        manifests = _committed_manifests(output, plan)
    if is_ltx(plan):
        names = sample_names(plan)
        for manifest in manifests:
            bucket = plan.unit(manifest.unit).bucket
            for key, source_id in zip(manifest.keys, manifest.source_ids):
                tensors = {}
                for field, folder in RECORD_FOLDERS.items():
                    relative = f"{folder}/{names[source_id]}"
                    if relative in (manifest.files or {}):
                        tensors[field] = load_record(output.local / relative)["latents"]
                yield key, bucket, tensors
        return
    layout = Layout.of_plan(plan.settings)
    wanted = set(LATENT_FIELDS)
    for manifest in manifests:
        if not manifest.keys:
            continue
        bucket = plan.unit(manifest.unit).bucket
        with output.open(manifest.shard) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            key, members = None, {}
            for member in tar:
                name, _, extension = member.name.partition(".")
                if name != key and key is not None:
                    yield key, bucket, _latents(layout.read(members, key), key, wanted)
                    members = {}
                key = name
                if member.isfile():
                    members[extension] = tar.extractfile(member).read()
            if key is not None:
                yield key, bucket, _latents(layout.read(members, key), key, wanted)


def _latents(fields: dict[str, Any], key: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    return {name: latent_of(name, value, key) for name, value in fields.items() if name in wanted}


def dataset_stats(output: Any, plan: Any, *, full_cov: bool = False) -> dict[str, Any]:
    """The statistics of every committed latent of ``output``: the ``latents`` field's at the top (GAE's dict),
    ``audio_latents`` (LTX-2) under that key, and for a dataset of several buckets ``buckets``: bucket -> the
    same for its samples."""
    totals: dict[str, LatentStats] = {}
    per_bucket: dict[str, dict[str, LatentStats]] = {}
    for _key, bucket, tensors in stored_latents(output, plan):
        for field, tensor in tensors.items():
            totals.setdefault(field, LatentStats(full_cov)).add(tensor)
            if bucket is not None:
                per_bucket.setdefault(bucket, {}).setdefault(field, LatentStats(full_cov)).add(tensor)
    return _arrange(totals, per_bucket if len(per_bucket) > 1 else {})


def _arrange(totals: dict[str, LatentStats], per_bucket: dict[str, dict[str, LatentStats]]) -> dict[str, Any]:
    top = next((field for field in LATENT_FIELDS if field in totals and LATENT_READERS[field].top), None)
    stats: dict[str, Any] = _result(top, totals[top]) if top is not None else {}
    for field, moments in totals.items():
        if field != top:
            stats[contract.field_stem(field)] = _result(field, moments)
    if per_bucket:
        stats["buckets"] = {bucket: _arrange(fields, {}) for bucket, fields in sorted(per_bucket.items())}
    return stats


def _result(field: str, moments: LatentStats) -> dict[str, Any]:
    of = LATENT_READERS[field].of
    return moments.result() | ({"of": of} if of else {})


def fields_stats(fields: dict[str, LatentStats]) -> dict[str, Any]:
    """Moments per latent field (e.g. a layout's own pass over what it stored) as ``dataset_stats``'s dict."""
    return _arrange(fields, {}) if fields else {}


def same_stats(merged: dict[str, Any], seen: dict[str, Any]) -> bool:
    """Whether two statistics dicts give the same mean and std, to float32 precision (both are float64 sums, merged
    in another order, then cast: they may differ in the float32 values' last bit)."""
    return all(torch.allclose(merged[k].double(), seen[k].double(), rtol=1e-6, atol=1e-8) for k in ("mean", "std"))


def has_covariance(stats: dict[str, Any] | None) -> bool:
    """Whether a statistics dict holds a channel covariance anywhere: the latents', another field's (LTX-2 audio),
    or a bucket's."""
    if not stats:
        return False
    return "cov" in stats or any(isinstance(value, dict) and has_covariance(value) for value in stats.values())


def load_stats(data: bytes | None) -> dict[str, Any] | None:
    """A statistics file's dict (weights only), or None for no file."""
    return None if data is None else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def kept_richer(output: Any, plan: Any, data: bytes) -> tuple[bytes, str | None]:
    """What to write over ``.diffprep/latent_stats.pt`` instead of ``data``, and why: where the file there holds a
    covariance and ``data`` does not (units encoded without ``--full-cov``, after ``diffprep latent-stats
    --full-cov``), the statistics of every stored latent with the covariance, computed again, so a trainer's
    whitening is never lost to a re-validation; otherwise ``data`` itself (and no reason)."""
    from diffprep.writer.shards import torch_bytes

    if has_covariance(load_stats(data)) or not has_covariance(load_stats(
            output.state.read_bytes(contract.LATENT_STATS))):
        return data, None
    if plan is None:  # nothing to compute them again from: the richer file stays as it is
        return output.state.read_bytes(contract.LATENT_STATS), (
            f"{contract.STATE_DIR}/{contract.LATENT_STATS} holds the full covariance: kept as it is (no plan.json "
            "to compute it again from)")
    return torch_bytes(dataset_stats(output, plan, full_cov=True)), (
        f"{contract.STATE_DIR}/{contract.LATENT_STATS} held the full covariance: computed again with it over every "
        "stored latent, not replaced by per-channel statistics (`diffprep latent-stats OUT --no-full-cov` writes "
        "those)")


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """What the validation summary and the command print: the count, samples and (full covariance) condition."""
    if "mean" not in stats:  # audio only: its field's
        stats = next(value for value in stats.values() if isinstance(value, dict) and "mean" in value)
    line = {"count": int(stats["count"]), "samples": int(stats["samples"]), "channels": int(stats["mean"].shape[0])}
    if "of" in stats:
        line["of"] = stats["of"]
    if "condition" in stats:
        line["condition"] = float(stats["condition"])
    return line


__all__ = ["LATENT_FIELDS", "LATENT_READERS", "LatentField", "LatentStats", "UnitStats", "dataset_stats",
           "fields_stats", "finalized_stats", "has_covariance", "kept_richer", "latent_of", "load_stats",
           "merge_units", "merged_unit_stats", "same_stats", "stored_latents", "summary", "unit_moments",
           "unit_stats_path"]
