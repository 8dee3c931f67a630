"""Encoders by model family (Flux first) and the resolution of their folders (local or hub)."""

from diffprep.encoders.flux import DTYPES, FluxEncoders, TextEmbeddings, describe_flux, noise_seed, resolve_device
from diffprep.encoders.hub import FLUX_PARTS, ResolvedPart, resolve_component, resolve_encoders, resolve_token

__all__ = [
    "DTYPES",
    "FLUX_PARTS",
    "FluxEncoders",
    "ResolvedPart",
    "TextEmbeddings",
    "describe_flux",
    "noise_seed",
    "resolve_component",
    "resolve_device",
    "resolve_encoders",
    "resolve_token",
]
