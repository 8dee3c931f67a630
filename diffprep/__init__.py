"""diffprep: pre-encode image-caption datasets for diffusion training."""

import logging

__version__ = "0.1.0"

# diffusers imports bitsandbytes whenever it is installed (the LTX-2 8-bit text encoder), and on an AVX-512 CPU
# bitsandbytes then warns that it could not fetch an optional 4-bit kernel from the Hugging Face hub: nothing
# diffprep uses (int8 only, offline), on every command. That module logs nothing else.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
