"""Phase 1, fetch: resolve the source and the encoders, fingerprint the settings, plan the units.

The encoders are resolved (downloaded where needed: only the subfolders the
encoders use) but not loaded; their configs give the shapes every sample must
have. A raw plan (``encoding="raw"``) resolves no encoder: its samples must
have the image, caption and meta fields. The output directory is only read here (an earlier plan of the same
fingerprint is extended, for appends); the plan goes to a staging file until
the verify phase decides where it may be written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from diffprep import contract
from diffprep.config import Settings
from diffprep.encoders import DTYPES, describe_flux, resolve_encoders, resolve_token
from diffprep.errors import ConfigError, SourceError
from diffprep.plan import Plan, fingerprint, plan_units, read_plan, write_plan
from diffprep.raw import raw_fields
from diffprep.sources import Source, open_source


def byte_settings(settings: Settings, encoders: dict[str, Any]) -> dict[str, Any]:
    """The settings that change the bytes of a shard, and so the fingerprint."""
    return {
        "contract": contract.CONTRACT_VERSION,
        "encoding": contract.ENCODING_PREENCODED,
        "encoders": encoders,
        "shard_size": settings.output.shard_size,
        "image": _image_settings(settings),
    }


def raw_byte_settings(settings: Settings) -> dict[str, Any]:
    """The fingerprinted settings of a raw dataset: image sizing and the stored file format, no encoders."""
    raw = settings.raw
    quality = None if raw.image_format == "png" else raw.image_quality
    return {
        "contract": contract.CONTRACT_VERSION,
        "encoding": contract.ENCODING_RAW,
        "shard_size": settings.output.shard_size,
        "image": _image_settings(settings),
        # png is lossless: its quality setting changes no byte.
        "raw": {"image_format": raw.image_format, "image_quality": quality},
    }


def _image_settings(settings: Settings) -> dict[str, Any]:
    image = settings.image
    return {
        "image_size": image.image_size,
        "center_crop": image.center_crop,
        "variable_size": image.variable_size,
        "max_size": image.max_size,
        "max_pixels": image.max_pixels,
        "background": list(image.background),
    }


def expected_shapes(settings: Settings, parts) -> dict[str, Any]:
    """Shapes and dtype of every sample, from the encoders' configs (None: varies per sample)."""

    def config(name: str) -> dict:
        return json.loads((parts[name].path / "config.json").read_text(encoding="utf-8"))

    vae = config("vae")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    if settings.image.variable_size:
        spatial: list[int | None] = [None, None]
    else:
        spatial = [settings.image.image_size // factor] * 2
    return {
        contract.field_stem(contract.LATENTS): [vae["latent_channels"], *spatial],
        contract.field_stem(contract.PROMPT_EMBEDS): [settings.model.t5_max_length, config("t5_text")["d_model"]],
        contract.field_stem(contract.POOLED_PROMPT_EMBEDS): [config("clip_text")["hidden_size"]],
        "dtype": str(DTYPES[settings.model.precision]).removeprefix("torch."),
    }


def staging_path(out_dir: str | os.PathLike) -> Path:
    """Where a plan waits for the verify phase: outside the output, one file per output path."""
    key = fingerprint({"out": str(Path(out_dir).resolve())})
    folder = Path(tempfile.gettempdir()) / "diffprep-staging"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"plan-{key}.json"


def fetch(
    settings: Settings,
    out_dir: str | os.PathLike | None = None,
    *,
    token: str | None = None,
    encoding: str = contract.ENCODING_PREENCODED,
) -> tuple[Plan, Source]:
    """Resolve everything and plan the units. Reads ``out_dir`` (default: the settings') but writes nothing there.

    ``token``: a Hugging Face token; by default the token file, ``HF_TOKEN`` or the cached login.
    ``encoding``: ``raw`` plans a dataset of image files and captions; no encoder is resolved.
    """
    out_dir = Path(out_dir or settings.output.output_dir)
    token = token or resolve_token(settings.auth.hf_token_file)
    if encoding == contract.ENCODING_RAW:
        byte = raw_byte_settings(settings)
        expected: dict[str, Any] = {"fields": raw_fields(settings.raw.image_format)}
    elif encoding == contract.ENCODING_PREENCODED:
        parts = resolve_encoders(settings.model, token=token)
        identity = describe_flux(
            parts,
            dtype=DTYPES[settings.model.precision],
            t5_max_length=settings.model.t5_max_length,
            latent_mode=settings.model.latent_mode,
        )
        byte = byte_settings(settings, identity)
        expected = expected_shapes(settings, parts)
    else:
        raise ConfigError(f"encoding must be one of {list(contract.ENCODINGS)}, got {encoding!r}")
    fp = fingerprint(byte)
    source = open_source(settings.source, token=token)
    previous = read_plan(out_dir) if out_dir.is_dir() else None
    if previous is not None and previous.fingerprint != fp:
        previous = None  # other settings: verify-existing will ask what to do
    units, missing, missing_count = plan_units(
        source.list_ids(),
        shard_size=settings.output.shard_size,
        max_samples=settings.output.max_samples,
        previous=previous,
    )
    if not units:
        raise SourceError(f"the source holds no samples: {json.dumps(source.describe())}")
    plan = Plan(
        fingerprint=fp,
        settings=byte,
        source=source.describe(),
        expected=expected,
        units=units,
        encoding=encoding,
        missing=missing,
        missing_count=missing_count,
    )
    return plan, source


def stage_plan(plan: Plan, out_dir: str | os.PathLike) -> Path:
    return write_plan(staging_path(out_dir), plan)
