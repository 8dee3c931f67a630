"""Prefect blocks: saved settings and secrets that flows accept by name.

Register them once per server: ``prefect block register -m diffprep.blocks``.
"""

from diffprep.blocks.aws_credentials import AwsS3Credentials
from diffprep.blocks.encoder_spec import EncoderSpec
from diffprep.blocks.hf_credentials import HuggingFaceCredentials

__all__ = ["AwsS3Credentials", "EncoderSpec", "HuggingFaceCredentials"]
