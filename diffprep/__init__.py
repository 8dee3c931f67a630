"""diffprep: pre-encode image-caption datasets for diffusion training."""

from diffprep.families.ltx2_torchaudio import allow_torchaudio_without_extension

__version__ = "0.1.0"

# Before anything imports torchaudio (ltx-core, transformers, diffusers): see that module.
allow_torchaudio_without_extension()
