"""The output contract, declared once.

Every name that appears on disk (sample fields, state files, shard and key
formats) lives here; the writer, the audit, finalize, validate and the tests
import it instead of spelling the strings again.
"""

from __future__ import annotations

import re

CONTRACT_VERSION = 1

# Per-sample fields of a pre-encoded shard (the webdataset extension of each member).
LATENTS = "latents.pth"
PROMPT_EMBEDS = "prompt_embeds.pth"
POOLED_PROMPT_EMBEDS = "pooled_prompt_embeds.pth"
CAPTION = "caption.txt"
META = "meta.json"
PREENCODED_FIELDS = (LATENTS, PROMPT_EMBEDS, POOLED_PROMPT_EMBEDS, CAPTION, META)
TENSOR_FIELDS = (LATENTS, PROMPT_EMBEDS, POOLED_PROMPT_EMBEDS)
# A video family's sample (Wan): latents [C, F', H/s, W/s] and the text sequence [L, D]; no pooled embedding.
VIDEO_FIELDS = (LATENTS, PROMPT_EMBEDS, CAPTION, META)
# latent_mode "posterior" adds the VAE's raw posterior (no shift, no scale; logvar clamped to [-30, 20]).
MEAN = "mean.pth"
LOGVAR = "logvar.pth"
POSTERIOR_FIELDS = (MEAN, LOGVAR)

# Per-sample fields of a raw (not pre-encoded) shard: one image file and its caption.
RAW_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
RAW_CAPTION = "txt"

# Classifier-free guidance files at the output's top, for trainers that read them from a folder (Primus's
# empty_encodings_path): the empty caption's T5 sequence [1, L, 4096] and CLIP pooled [1, 768], float32 .npy.
EMPTY_ENCODINGS_DIR = "empty_encodings"
T5_EMPTY = "t5_empty.npy"
CLIP_EMPTY = "clip_empty.npy"

# Output layouts (``output.layout``): energon writes the fields above under their own names; a trainer's
# layout writes the same samples under the member names that trainer reads by default.
LAYOUT_ENERGON = "energon"
LAYOUT_FASTGEN = "fastgen"
# NVIDIA FastGen's latent loaders: the latents and the text condition (Flux: the tuple (pooled, t5)).
FASTGEN_LATENT = "latent.pth"
FASTGEN_TXT_EMB = "txt_emb.pth"
# At the output's top, for a relative FastGen ``files_map`` path (joined to the datatag's dirname): the negative
# prompt's embeddings, one sample without a batch dimension, float32 .npy (Flux: the T5 sequence, and the CLIP
# pooled vector in a second file: an .npy holds one array, not the tuple), and shard -> samples for its
# deterministic resume.
NEG_PROMPT_EMB = "neg_prompt_emb.npy"
NEG_POOLED_PROMPT_EMB = "neg_pooled_prompt_emb.npy"
SHARD_COUNTS_JSON = "shard_counts.json"
LAYOUT_FILES = (NEG_PROMPT_EMB, NEG_POOLED_PROMPT_EMB, SHARD_COUNTS_JSON)

# Energon subflavor values.
ENCODING_PREENCODED = "preencoded"
ENCODING_RAW = "raw"
ENCODING_WAN = "wan"  # pre-encoded with a Wan 2.x model (video)
ENCODINGS = (ENCODING_PREENCODED, ENCODING_RAW, ENCODING_WAN)

# Energon's metadata folder and the files in it.
NV_META = ".nv-meta"
DATASET_YAML = "dataset.yaml"
SPLIT_YAML = "split.yaml"
INFO_JSON = ".info.json"
INDEX_SQLITE = "index.sqlite"
SPLITS = ("train", "val", "test")

# diffprep's own state folder and the files in it.
STATE_DIR = ".diffprep"
PLAN_JSON = "plan.json"
UNITS_DIR = "units"
TMP_DIR = "tmp"
AUDIT_JSON = "audit.json"
VALIDATION_JSON = "validation.json"
SPLITS_JSON = "splits.json"
LATENT_STATS = "latent_stats.pt"
EMPTY_PROMPT = "empty_prompt.pth"
SANITY_DIR = "sanity"
SANITY_REPORT = "report.json"
SANITY_SAMPLE = "sample.pth"
MSC_CONFIG = "msc_config.yaml"
LOCK_FILE = "lock.json"

SHARD_SUFFIX = ".tar"
INDEX_SUFFIX = ".tar.idx"
_SHARD_RE = re.compile(r"^(\d{6,})\.tar$")
_KEY_RE = re.compile(r"^(\d{6,})_(\d{6,})$")


def shard_name(unit: int) -> str:
    """Tar shard name of a work unit: ``000042.tar``."""
    if unit < 0:
        raise ValueError(f"unit must be >= 0, got {unit}")
    return f"{unit:06d}{SHARD_SUFFIX}"


def unit_of_shard(name: str) -> int | None:
    """Unit index of a shard file name, or None when the name is not one of ours."""
    match = _SHARD_RE.match(name)
    return int(match.group(1)) if match else None


def sample_key(unit: int, index: int) -> str:
    """Globally unique sample key ``<unit:06d>_<index:06d>`` (no dots: Energon splits on the first one)."""
    if unit < 0 or index < 0:
        raise ValueError(f"unit and index must be >= 0, got unit={unit} index={index}")
    return f"{unit:06d}_{index:06d}"


def parse_sample_key(key: str) -> tuple[int, int]:
    match = _KEY_RE.match(key)
    if not match:
        raise ValueError(f"not a diffprep sample key: {key!r} (expected <unit:06d>_<index:06d>)")
    return int(match.group(1)), int(match.group(2))


def field_stem(field: str) -> str:
    """``latents.pth`` -> ``latents``: how plan.json's ``expected`` names a field."""
    return field.partition(".")[0]


def unit_manifest_name(unit: int) -> str:
    return f"{unit:06d}.json"


def unit_manifest_path(unit: int) -> str:
    """A unit's manifest, relative to the output: ``.diffprep/units/000042.json``."""
    return f"{STATE_DIR}/{UNITS_DIR}/{unit_manifest_name(unit)}"


def lock_file_name(shard: int | None = None) -> str:
    """``lock.json`` of a plain run, ``lock-shard-0003.json`` of a ``--shard-index`` run (in the state folder)."""
    return LOCK_FILE if shard is None else f"lock-shard-{shard:04d}.json"


def is_lock_file(name: str) -> bool:
    return name == LOCK_FILE or re.fullmatch(r"lock-shard-\d+\.json", name) is not None
