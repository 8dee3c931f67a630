"""diffprep: pre-encode image-caption datasets for diffusion training."""

__version__ = "0.1.0"
