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
# A Wan clip's depth clip (--depth-column) through the same VAE: shaped and normalized as its latents (FastGen's
# key_map["depth_latent"], VACE v2v).
DEPTH_LATENT = "depth_latent.pth"
# An LTX-2 sample (Energon layout): video latents [128, F', H/32, W/32] bf16, the clip's audio latents [8, T, 16]
# float32 (not with --skip-audio), the Gemma feature extractor's output [1024, D] bf16 (prompt_embeds; the audio
# one only where the checkpoint projects it separately, LTX-2.3) and its left-padded mask [1024] int64, and an
# IC-LoRA run's reference clip latents. Audio-only runs (T2A) have no video latents.
AUDIO_LATENTS = "audio_latents.pth"
AUDIO_PROMPT_EMBEDS = "audio_prompt_embeds.pth"
PROMPT_ATTENTION_MASK = "prompt_attention_mask.pth"
REFERENCE_LATENTS = "reference_latents.pth"
# The other inputs of a clip (metadata columns reference_audio, video_mask, audio_mask): the reference sound's
# audio latents [8, T, 16] float32, inpainting masks in the latent grid, float 0/1: video [F', H', W'], audio [T'].
REFERENCE_AUDIO_LATENTS = "reference_audio_latents.pth"
VIDEO_MASK = "video_mask.pth"
AUDIO_MASK = "audio_mask.pth"
LTX2_TENSOR_FIELDS = (AUDIO_LATENTS, AUDIO_PROMPT_EMBEDS, PROMPT_ATTENTION_MASK, REFERENCE_LATENTS,
                      REFERENCE_AUDIO_LATENTS, VIDEO_MASK, AUDIO_MASK)
# latent_mode "posterior" adds the VAE's raw posterior (no shift, no scale; logvar clamped to [-30, 20]).
MEAN = "mean.pth"
LOGVAR = "logvar.pth"
POSTERIOR_FIELDS = (MEAN, LOGVAR)

# Per-sample fields of a raw (not pre-encoded) shard: one image file and its caption.
RAW_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
RAW_CAPTION = "txt"
# A raw video shard (FastGen's VideoWDSLoader and most webdataset video loaders): the bucketed clip as an H.264 mp4,
# its caption and its metadata (source id, fps, frame indices, bucket, crop box).
RAW_VIDEO = "mp4"
RAW_VIDEO_META = "json"
RAW_VIDEO_FIELDS = (RAW_VIDEO, RAW_CAPTION, RAW_VIDEO_META)

# A raw posed-scene shard (--source-type scenes, diffprep raw; FastGen's documented camera-video contract): the
# scene's frames as an H.264 mp4, its caption, OpenCV camera-to-world float32 [T, 4, 4] and fx fy cx cy float32
# [T, 4] in pixels of the stored mp4 (row i = decoded frame i), its metadata (fps, width, height, num_frames...), and
# for depth sources the depth maps, uint16 millimetres [T, d, d].
SCENE_POSES = "poses.npy"
SCENE_INTRINSICS = "intrinsics.npy"
SCENE_DEPTH = "depth.npy"
SCENE_FIELDS = (RAW_VIDEO, RAW_CAPTION, SCENE_POSES, SCENE_INTRINSICS, RAW_VIDEO_META)
# A pre-encoded scene (Wan) adds to VIDEO_FIELDS each source frame's camera-to-world [F, 4, 4] and K [F, 3, 3].
SCENE_C2W = "c2w.pth"
SCENE_K = "intrinsics.pth"
WAN_SCENE_FIELDS = (*VIDEO_FIELDS, SCENE_C2W, SCENE_K)
# --layout gae (GAE's scene packers' schema): <out>/[<split>/]<scene>/ holding these; a chunk of a long scene is a
# chunk_NNN folder inside its scene's.
GAE_VIDEO = "video.mp4"
GAE_META = "meta.json"
GAE_CAPTION = "caption.txt"
GAE_DEPTH = "depth.npz"
GAE_DEPTH_KEY = "depth_mm"

# An ingested MLPerf Flux sample (``diffprep ingest``, Primus's ``encoding: preencoded_numpy``): the stored
# arrays as they came, each an ``.npy`` of uint16 words that are bfloat16 values (T5 sequence [L, 4096], CLIP
# pooled [768], the VAE posterior's mean and logvar [16, H/8, W/8]), and a JSON record of where the row came from.
T5_BYTES = "t5.bytes"
CLIP_BYTES = "clip.bytes"
MEAN_BYTES = "mean.bytes"
LOGVAR_BYTES = "logvar.bytes"
INGESTED_META = "json"
INGESTED_FIELDS = (T5_BYTES, CLIP_BYTES, MEAN_BYTES, LOGVAR_BYTES, INGESTED_META)
# The Arrow IPC stream columns of an MLPerf Flux file, in the order of the fields above; ``__key__`` is optional.
MLPERF_COLUMNS = ("t5_encodings", "clip_encodings", "mean", "logvar")
MLPERF_KEY_COLUMN = "__key__"
# An MLPerf manifest: ``<name>.uri`` holds the base URL, ``<name>.md5`` lines of ``<md5>  <file name>``.
MANIFEST_URI_SUFFIX = ".uri"
MANIFEST_MD5_SUFFIX = ".md5"

# Classifier-free guidance files at the output's top, for trainers that read them from a folder (Primus's
# empty_encodings_path): the empty caption's T5 sequence [1, L, 4096] and CLIP pooled [1, 768], float32 .npy.
EMPTY_ENCODINGS_DIR = "empty_encodings"
T5_EMPTY = "t5_empty.npy"
CLIP_EMPTY = "clip_empty.npy"
PROMPT_EMBEDS_EMPTY = "prompt_embeds_empty.npy"  # a Wan run's: the empty caption's umT5 sequence [1, L, 4096]

# Output layouts (``output.layout``): energon writes the fields above under their own names; fastgen writes the
# same shards under the member names FastGen reads by default; ltx writes the LTX-2 trainer's own folders (below).
LAYOUT_ENERGON = "energon"
LAYOUT_FASTGEN = "fastgen"
LAYOUT_LTX = "ltx"
LAYOUT_EDM_ZIP = "edm-zip"
LAYOUT_GAE = "gae"
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
IGNORE_INDEX_JSON = "ignore_index.json"  # FastGen's ignore_index_paths file (diffprep ignore-list)
# With --score-column, the fastgen layout writes meta.json as this member: FastGen's presets_filter reads it.
SCORE_JSON = "json"
LAYOUT_FILES = (NEG_PROMPT_EMB, NEG_POOLED_PROMPT_EMB, SHARD_COUNTS_JSON, IGNORE_INDEX_JSON)

# --layout edm-zip: the archive EDM's and EDM2's dataset_tool write and FastGen's ImageFolderDataset reads, at the
# output's top; assembled at finalize from the committed shards (the units' commit points, kept for resume).
# Inside it: the data files under EDM_ZIP_FOLDER/EDM_ZIP_IMAGE (or EDM_ZIP_LATENT) with an 8-digit contiguous
# index, the folder being its first five digits, and EDM_ZIP_LABELS ({"labels": [[name, label], ...]} or null).
EDM_ZIP = "dataset.zip"
EDM_ZIP_LABELS = "dataset.json"
EDM_ZIP_INDEX_DIGITS = 8
EDM_ZIP_FOLDER_DIGITS = 5
EDM_ZIP_IMAGE = "img{index}.png"
EDM_ZIP_LATENT = "img-mean-std-{index}.npy"
# The crops of the tools FastGen runs (--crop): EDM's center-crop, EDM2's center-crop-dhariwal (ADM's).
CROP_EDM = "edm"
CROP_ADM = "adm"
CROPS = (CROP_EDM, CROP_ADM)


def edm_zip_name(index: int, template: str = EDM_ZIP_IMAGE) -> str:
    """The archive name of the ``index``-th data file: ``NNNNN/imgNNNNNNNN.png`` (folder = the first five digits)."""
    digits = f"{index:0{EDM_ZIP_INDEX_DIGITS}d}"
    if len(digits) != EDM_ZIP_INDEX_DIGITS:
        raise ValueError(f"an edm-zip archive holds at most {10 ** EDM_ZIP_INDEX_DIGITS} files, index {index}")
    return f"{digits[:EDM_ZIP_FOLDER_DIGITS]}/{template.format(index=digits)}"

# Energon subflavor values.
ENCODING_PREENCODED = "preencoded"
ENCODING_RAW = "raw"
ENCODING_WAN = "wan"  # pre-encoded with a Wan 2.x model (video)
ENCODING_LTX2 = "ltx2"  # pre-encoded with an LTX-2 checkpoint (video + audio)
ENCODING_RAW_VIDEO = "raw_video"  # clips stored as mp4, not encoded
ENCODING_LTX2_AUDIO = "ltx2_audio"  # LTX-2 audio only (T2A): audio latents and text, no video latents
ENCODING_PREENCODED_NUMPY = "preencoded_numpy"  # already encoded elsewhere, ingested as stored (MLPerf Flux)
ENCODING_SD_VAE = "sd_vae"  # the SD VAE's posterior (mean, std) per image, written as an edm-zip archive
ENCODING_PROMPTS = "prompts"  # captions only (FastGen's PromptLoaderConfig): txt + json, no media stored
ENCODING_SCENES = "scenes"  # posed scenes stored raw: mp4 + per-frame cameras (shards, or GAE's scene folders)
ENCODING_WAN_SCENES = "wan_scenes"  # posed scenes pre-encoded with a Wan 2.x model, with per-frame cameras
ENCODINGS = (ENCODING_PREENCODED, ENCODING_RAW, ENCODING_WAN, ENCODING_LTX2, ENCODING_RAW_VIDEO, ENCODING_LTX2_AUDIO,
             ENCODING_PREENCODED_NUMPY, ENCODING_SD_VAE, ENCODING_PROMPTS, ENCODING_SCENES, ENCODING_WAN_SCENES)
# An sd_vae sample's posterior: float32 [8, H/8, W/8], the mean then the std, as a .npy (the archive's bytes).
SD_VAE_POSTERIOR = "mean_std.npy"

# The LTX-2 trainer's layout (--layout ltx; reference/consumer-formats.md A1/A2): under <out>/.precomputed/, one
# torch.save'd dict per sample and folder, named after the sample's media path relative to the metadata file with
# the suffix .pt. The .precomputed folder is the output's root: its .diffprep/ state sits inside it, and a new
# directory is .precomputed-v2.
PRECOMPUTED_DIR = ".precomputed"
LATENTS_DIR = "latents"
CONDITIONS_DIR = "conditions"
AUDIO_LATENTS_DIR = "audio_latents"
REFERENCE_LATENTS_DIR = "reference_latents"
REFERENCE_AUDIO_LATENTS_DIR = "reference_audio_latents"
VIDEO_MASKS_DIR = "video_masks"
AUDIO_MASKS_DIR = "audio_masks"
PRECOMPUTED_DIRS = (LATENTS_DIR, CONDITIONS_DIR, AUDIO_LATENTS_DIR, REFERENCE_LATENTS_DIR, REFERENCE_AUDIO_LATENTS_DIR,
                    VIDEO_MASKS_DIR, AUDIO_MASKS_DIR)
PRECOMPUTED_SUFFIX = ".pt"
# The keys of each record (A1).
VIDEO_RECORD_KEYS = ("latents", "num_frames", "height", "width", "fps")
AUDIO_RECORD_KEYS = ("latents", "num_time_steps", "frequency_bins", "duration")
CONDITIONS_RECORD_KEYS = ("video_prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")
MASK_RECORD_KEYS = ("mask",)

# Energon's metadata folder and the files in it.
NV_META = ".nv-meta"
DATASET_YAML = "dataset.yaml"
SPLIT_YAML = "split.yaml"
INFO_JSON = ".info.json"
INDEX_SQLITE = "index.sqlite"
# Written by Energon's prepare too: the dataset's id, and the legacy YAML form of .info.json.
INDEX_UUID = "index.uuid"
INFO_YAML = ".info.yaml"
SPLITS = ("train", "val", "test")

# diffprep's own state folder and the files in it.
STATE_DIR = ".diffprep"
PLAN_JSON = "plan.json"
UNITS_DIR = "units"
# Each planned unit's sample ids (and their locators), one JSON-lines file per unit: plan.json holds units only.
PLAN_UNITS_DIR = "plan_units"
UNIT_STATS_DIR = "unit_stats"  # --full-cov: each unit's latent moments (NNNNNN.pt), written before its manifest
TMP_DIR = "tmp"
# Each shard's tar members as its writer wrote them (name, header and data offsets, size; NNNNNN.json): finalize
# builds Energon's index from them instead of reading every tar again.
MEMBERS_DIR = "members"
AUDIT_JSON = "audit.json"
# The answer given to the rejects question, for the rejects it was asked about (their digest): it holds for them on
# later runs; other rejects are asked about again.
REJECTS_ANSWER_JSON = "rejects_answer.json"
DISCARD_ANSWER_JSON = "discard_answer.json"  # long videos: the accepted frames in shots shorter than every bucket
VALIDATION_JSON = "validation.json"
IGNORE_REPORT_JSON = "ignore_report.json"  # diffprep ignore-list: every broken key with its reasons
SPLITS_JSON = "splits.json"
LATENT_STATS = "latent_stats.pt"
EMPTY_PROMPT = "empty_prompt.pth"
SANITY_DIR = "sanity"
# An ingest's downloads while they wait for their unit (``diffprep ingest``): removed once the unit is committed.
DOWNLOADS_DIR = "downloads"
DOWNLOAD_PART_SUFFIX = ".part"
# Scratch of a run in progress, never published: the caption encodings its processes on one machine share
# (text_cache/<fingerprint>/<sha256 of the caption>.pt, diffprep.families.text_cache); removed after the units.
TEXT_CACHE_DIR = "text_cache"
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


def index_name(shard: str) -> str:
    """The Energon index Energon's prepare writes beside a shard: ``000042.tar`` -> ``000042.tar.idx``."""
    return shard.removesuffix(SHARD_SUFFIX) + INDEX_SUFFIX


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


def plan_unit_path(unit: int) -> str:
    """A unit's sample list, relative to the state folder: ``plan_units/000042.jsonl``."""
    return f"{PLAN_UNITS_DIR}/{unit:06d}.jsonl"


def lock_file_name(shard: int | None = None) -> str:
    """``lock.json`` of a plain run, ``lock-shard-0003.json`` of a ``--shard-index`` run (in the state folder)."""
    return LOCK_FILE if shard is None else f"lock-shard-{shard:04d}.json"


def is_lock_file(name: str) -> bool:
    return name == LOCK_FILE or re.fullmatch(r"lock-shard-\d+\.json", name) is not None


# --- GAE's text-to-image co-training roots (diffprep/tools/t2i.py, t2i_verify.py, t2i_mirror.py) -----------------------
# A T2I root holds one sub-folder per split; GAE's loader (src/data/blip3o_wds.py) globs each one's ``*.tar``
# (not recursively) and searches its roots in order, the first with shards winning. An ImageNet shard counts only
# when ``<shard>.done`` exists beside it. Samples: ``<key>.jpg|png|jpeg|webp`` + ``<key>.txt`` (or ``<key>.json``).
T2I_SPLIT_FOLDERS: dict[str, str] = {
    "long": "BLIP3o-Pretrain-Long-Caption",
    "short": "BLIP3o-Pretrain-Short-Caption",
    "journeydb": "BLIP3o-Pretrain-JourneyDB",
    "imagenet": "ImageNet-1K-T2I",
}
T2I_DONE_SPLITS = frozenset({"imagenet"})  # the splits whose shards the loader takes only with a .done marker
T2I_IMAGE_MEMBERS = ("jpg", "png", "jpeg", "webp")  # the image members the loader looks for, in its order
T2I_CAPTION = "txt"
T2I_CAPTION_JSON = "json"
T2I_DONE_SUFFIX = ".done"
T2I_SHARD_SIZE = 10_000  # `diffprep t2i imagenet`'s samples per shard: GAE's --samples-per-shard default
T2I_SEED = 0  # its shuffle's default seed
T2I_PLAN_JSON = "t2i_plan.json"  # in the state folder: seed, shard size, every shard's source ids
_T2I_SHARD_RE = re.compile(r"^imagenet_(\d{5,})\.tar$")


def t2i_shard_name(index: int) -> str:
    """An ImageNet T2I shard's name, as GAE's packer names them: ``imagenet_00042.tar``."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"imagenet_{index:05d}{SHARD_SUFFIX}"


def t2i_shard_index(name: str) -> int | None:
    match = _T2I_SHARD_RE.match(name)
    return int(match.group(1)) if match else None


def t2i_done_name(shard: str) -> str:
    """The marker GAE's loader requires beside an ImageNet shard: ``imagenet_00042.tar.done``."""
    return shard + T2I_DONE_SUFFIX


def t2i_key(wnid: str, stem: str) -> str:
    """GAE's ImageNet sample key ``imagenet_<wnid>_<stem>``."""
    return f"imagenet_{wnid}_{stem}"
