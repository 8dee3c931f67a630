"""``sd_vae``: images encoded by the SD VAE into its posterior (mean and std, ``[8, H/8, W/8]`` float32), written as
the edm-zip archive FastGen's ``ImageNet256_Loader_Config`` reads (``NNNNN/img-mean-std-NNNNNNNN.npy``).

Units are shards of ``mean_std.npy`` (numpy's own format, no pickle: the bytes
the archive stores) and ``meta.json`` (source id, crop, label), committed by their
manifests as every unit is; finalize assembles ``dataset.zip`` (``edm_zip``). The
only layout is edm-zip: no Energon loader reads these samples.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.encodings.base import Encoding, SampleFields
from diffprep.errors import ConfigError
from diffprep.media.images import ImageSpec
from diffprep.writer.layouts import LayoutPreset
from diffprep.output import Output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, SanityReport, finish_sanity, peak_memory, project_run
from diffprep.writer.shards import Reject, npy_bytes
from diffprep.sources import Source

BATCH_SIZE = 8
_LOADED: dict[tuple, Any] = {}  # (model, device, revision) -> the VAE this process loaded


class SdVaeWriter:
    """A batch of prepared pixels -> each sample's posterior ``.npy`` and meta."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded

    def sample_fields(self, batch: Batch, notes: Counter) -> list[dict | Reject]:
        posterior = self.loaded.posterior(batch.pixels)
        samples: list[dict | Reject] = []
        for i in range(len(batch.keys)):
            if not torch.isfinite(posterior[i]).all():
                samples.append(Reject(batch.source_ids[i], "non_finite_latents",
                                      "the VAE produced NaN or inf for this image", phase="encode"))
                continue
            samples.append({contract.SD_VAE_POSTERIOR: npy_bytes(posterior[i]), contract.META: batch.metas[i]})
        return samples


class SdVaeLatents(Encoding):
    name = contract.ENCODING_SD_VAE
    layout_presets = {contract.LAYOUT_EDM_ZIP: LayoutPreset(members={})}

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        from diffprep.encodings.edm_zip import check_settings, class_count
        from diffprep.families.sd_vae import latent_shape

        if settings.output.layout != contract.LAYOUT_EDM_ZIP:
            raise ConfigError("the sd-vae family writes FastGen's ImageNet-256 latents archive: add --layout edm-zip")
        check_settings(settings, image_files=False)
        model = settings.model
        identity = {"encoders": {"vae": {"path": model.vae_path or model.model_path, "revision": model.revision,
                                         "dtype": "float32"}}}
        identity |= class_count(settings)
        shape = latent_shape(settings.image.image_size)
        return self.byte_settings(settings, identity), {"fields": [contract.META, contract.SD_VAE_POSTERIOR],
                                                        "posterior": shape, "dtype": "float32"}

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected["fields"])

    def load(self, settings: Settings, token: str | None) -> Any:
        from diffprep.families.base import resolve_device
        from diffprep.families.sd_vae import load_sd_vae
        from diffprep.run.workers import claimed_device

        model = settings.model
        device = resolve_device(claimed_device() or model.device)
        key = (model.vae_path or model.model_path, str(device), model.revision)
        if key not in _LOADED:  # once per process, not per unit
            _LOADED.clear()
            _LOADED[key] = load_sd_vae(key[0], device=device, revision=model.revision, token=token)
        return _LOADED[key]

    def sample_fields(self, settings: Settings, loaded: Any) -> SampleFields:
        return SdVaeWriter(loaded).sample_fields

    def batch_size(self, settings: Settings) -> int:
        return BATCH_SIZE

    def sanity(self, output: Output, plan: Plan, loaded: Any, source: Source, spec: ImageSpec, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        batch = first_batch(plan, source, spec, batch_size)
        start = time.perf_counter()
        posterior = loaded.posterior(batch.pixels)
        seconds = time.perf_counter() - start
        finite = bool(torch.isfinite(posterior).all())
        per_sample = len(npy_bytes(posterior[0])) + 512 + TAR_MEMBER_OVERHEAD * 2
        remaining, projected, free = project_run(output, plan, units_left, seconds, len(batch.keys), workers)
        shape = list(posterior.shape[1:])
        problems = [] if shape == plan.expected["posterior"] else [
            f"posterior shape {shape}, planned {plan.expected['posterior']}"]
        problems += [] if finite else ["the VAE produced NaN or inf"]
        std = posterior[:, posterior.shape[1] // 2:]
        problems += [] if bool((std > 0).all()) else ["a posterior std is not positive"]
        report = SanityReport(ok=not problems, samples=len(batch.keys), shapes={contract.SD_VAE_POSTERIOR: shape},
                              dtypes={contract.SD_VAE_POSTERIOR: "float32"}, finite=finite, psnr_db=[],
                              seconds_per_batch=round(seconds, 4), peak_memory_bytes=peak_memory(loaded.device),
                              bytes_per_sample=per_sample, projected_bytes=per_sample * remaining,
                              projected_seconds=round(projected, 1), free_bytes=free, problems=problems)
        return finish_sanity(output, report, remaining)

    def oom_advice(self, settings: Settings, loaded: Any) -> str:
        return f"lower --image-size (now {settings.image.image_size})"

    def own_folders(self, plan: Plan | None) -> Any:
        from diffprep.encodings import edm_zip

        return edm_zip if edm_zip.is_edm_zip(plan) else None

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.SD_VAE_POSTERIOR in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor], str | None]:
        raise ConfigError("diffprep decode does not read sd-vae posteriors yet: load dataset.zip's .npy files with "
                          "numpy and decode mean through the VAE")

    def task_encoder(self) -> Any:
        raise ConfigError("sd-vae datasets are edm-zip archives, read by FastGen's ImageFolderDataset, not Energon")

    def inspector(self, expected: dict[str, Any] | None) -> Any:
        raise ConfigError("sd-vae datasets are validated as edm-zip archives (diffprep.encodings.edm_zip)")


def posterior_of(data: bytes) -> np.ndarray:
    """A stored ``.npy`` posterior, read without pickle."""
    import io

    return np.load(io.BytesIO(data), allow_pickle=False)


__all__ = ["SdVaeLatents", "SdVaeWriter", "posterior_of"]
