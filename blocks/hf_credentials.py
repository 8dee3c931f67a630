"""A saved Hugging Face token, stored as a secret (never shown in the UI, logs or parameters)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class HuggingFaceCredentials(Block):
    """A Hugging Face token for gated encoders such as FLUX.1-dev.

    Pass the block's name as ``auth.hf_credentials_block``; tasks load it where
    they run, so the token never travels in flow parameters.
    """

    _block_type_name = "diffprep hugging face credentials"
    _block_type_slug = "diffprep-hugging-face-credentials"
    _description = "A Hugging Face access token (read scope is enough) for downloading gated encoders."

    token: SecretStr = Field(description="A Hugging Face access token, hf_...")
