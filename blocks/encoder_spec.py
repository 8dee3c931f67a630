"""A saved encoder set: which model, per-encoder overrides, precision and T5 length."""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field

from diffprep.config import DEFAULT_MODEL, Precision


class EncoderSpec(Block):
    """Encoders for ``encode-dataset``: pass the block's name as the flow's ``encoder_spec`` parameter.

    Model fields given in the run's parameters win over the block's.
    """

    _block_type_name = "diffprep encoder spec"
    _block_type_slug = "diffprep-encoder-spec"
    _description = "Which Flux encoders diffprep uses: model path or hub repo, overrides, precision, T5 length."

    model_path: str = Field(DEFAULT_MODEL, description="Hub repo or local folder in the FLUX.1-dev layout.")
    revision: str | None = Field(None, description="Hub revision of model_path.")
    vae_path: str | None = Field(None, description="VAE override.")
    t5_path: str | None = Field(None, description="T5 override.")
    clip_path: str | None = Field(None, description="CLIP override.")
    precision: Precision | None = Field(None, description="bf16 | fp16 | fp32 (unset: the run's setting).")
    t5_max_length: int | None = Field(
        None, ge=1, le=512, description="512 for FLUX.1-dev, 256 for schnell (unset: the run's setting)."
    )

    def model_settings(self) -> dict[str, Any]:
        """The block's values as ``model`` settings (unset overrides left out)."""
        return self.model_dump(
            include={"model_path", "revision", "vae_path", "t5_path", "clip_path", "precision", "t5_max_length"},
            exclude_none=True,
        )
