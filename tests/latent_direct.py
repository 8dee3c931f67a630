"""Latent statistics computed directly, from every latent at once: what the tests compare latent_stats.pt with."""

from __future__ import annotations

import torch

# latent_stats.pt is float32 (GAE's dtype), cast from float64 sums merged in some order: its values may differ from
# the direct float64 ones by the float32 rounding (about 6e-8 relative) and a few merge-order bits.
RTOL, ATOL = 1e-6, 1e-7


def direct(latents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, population std and population covariance over every latent value, from all samples at once."""
    values = torch.cat([x.double().reshape(x.shape[0], -1) for x in latents], dim=1)
    return values.mean(dim=1), values.std(dim=1, correction=0), torch.cov(values, correction=0)


def close32(saved: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a float32 statistic of latent_stats.pt is ``want`` (float64) to float32 precision."""
    return saved.dtype == torch.float32 and torch.allclose(saved.double(), want.double(), rtol=RTOL, atol=ATOL)
