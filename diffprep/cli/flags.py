"""The flags of ``diffprep encode``, ``raw`` and ``ingest``: each flag's setting (section, key), its kind, and
the overrides a parsed command line gives (only the flags typed: argparse defaults are suppressed)."""

from __future__ import annotations

import argparse
from typing import Any

# flag -> (section, key); value types come from the settings models.
ENCODE_FLAGS: dict[str, tuple[str, str]] = {
    "--source-type": ("source", "type"),
    "--input-dir": ("source", "input_dir"),
    "--hf-dataset": ("source", "hf_dataset"),
    "--hf-split": ("source", "hf_split"),
    "--hf-data-files": ("source", "hf_data_files"),
    "--hf-revision": ("source", "hf_revision"),
    "--hf-streaming": ("source", "hf_streaming"),
    "--image-key": ("source", "image_key"),
    "--caption-key": ("source", "caption_key"),
    "--metadata-file": ("source", "metadata_file"),
    "--video-key": ("source", "video_key"),
    "--audio-column": ("source", "audio_key"),
    "--reference-column": ("source", "reference_key"),
    "--depth-column": ("source", "depth_key"),
    "--caption-template": ("source", "caption_template"),
    "--caption-set": ("source", "caption_set"),
    "--caption-index": ("source", "caption_index"),
    "--captions-dir": ("source", "captions_dir"),
    "--on-long-caption": ("source", "on_long_caption"),
    "--class-names": ("source", "class_names"),
    "--input-path": ("source", "input_path"),
    "--cifar-split": ("source", "cifar_split"),
    "--scene-format": ("source", "scene_format"),
    "--pose-key": ("source", "pose_key"),
    "--num-classes": ("source", "num_classes"),
    "--score-column": ("source", "score_columns"),
    "--s3-endpoint-url": ("source", "s3_endpoint_url"),
    "--s3-profile": ("source", "s3_profile"),
    "--output-dir": ("output", "output_dir"),
    "--output-s3-endpoint-url": ("output", "s3_endpoint_url"),
    "--output-s3-profile": ("output", "s3_profile"),
    "--shard-size": ("output", "shard_size"),
    "--max-samples": ("output", "max_samples"),
    "--compress": ("output", "compress"),
    "--on-existing": ("output", "on_existing"),
    "--accept-rejects": ("output", "accept_rejects"),
    "--approval-timeout": ("output", "approval_timeout"),
    "--layout": ("output", "layout"),
    "--key-map": ("output", "key_map"),
    "--model-path": ("model", "model_path"),
    "--revision": ("model", "revision"),
    "--vae-path": ("model", "vae_path"),
    "--t5-path": ("model", "t5_path"),
    "--clip-path": ("model", "clip_path"),
    "--precision": ("model", "precision"),
    "--device": ("model", "device"),
    "--batch-size": ("model", "batch_size"),
    "--t5-max-length": ("model", "t5_max_length"),
    "--latent-mode": ("model", "latent_mode"),
    "--min-psnr": ("model", "min_psnr"),
    "--text-cache-mib": ("model", "text_cache_mib"),
    "--negative-prompt": ("model", "negative_prompt"),
    "--family": ("model", "family"),
    "--text-encoder-path": ("model", "text_encoder_path"),
    "--load-text-encoder-in-8bit": ("model", "load_text_encoder_in_8bit"),
    "--lora-trigger": ("model", "lora_trigger"),
    "--resolution-buckets": ("video", "resolution_buckets"),
    "--target-fps": ("video", "target_fps"),
    "--frame-sampling": ("video", "frame_sampling"),
    "--split-scenes": ("video", "split_scenes"),
    "--min-scene-seconds": ("video", "min_scene_seconds"),
    "--scene-threshold": ("video", "scene_threshold"),
    "--clip-mode": ("video", "clip_mode"),
    "--clip-stride": ("video", "clip_stride"),
    "--clips-per-scene": ("video", "clips_per_scene"),
    "--scene-captions": ("video", "scene_captions"),
    "--vae-tiling": ("video", "vae_tiling"),
    "--skip-audio": ("video", "skip_audio"),
    "--audio-durations": ("video", "audio_durations"),
    "--reference-downscale-factor": ("video", "reference_downscale_factor"),
    "--image-size": ("image", "image_size"),
    "--center-crop": ("image", "center_crop"),
    "--crop": ("image", "crop"),
    "--variable-size": ("image", "variable_size"),
    "--max-size": ("image", "max_size"),
    "--max-pixels": ("image", "max_pixels"),
    "--min-image-size": ("image", "min_size"),
    "--decode-workers": ("image", "decode_workers"),
    "--buckets": ("image", "buckets"),
    "--train-split": ("finalize", "train_split"),
    "--finalize": ("finalize", "enabled"),
    "--full-cov": ("finalize", "full_cov"),
    "--on-split-change": ("finalize", "on_split_change"),
    "--hf-token-file": ("auth", "hf_token_file"),
    "--hf-credentials-block": ("auth", "hf_credentials_block"),
    "--devices": ("workers", "devices"),
    "--encode-deployment": ("workers", "deployment"),
    "--chunks": ("workers", "chunks"),
    "--num-shards": ("workers", "num_shards"),
    "--shard-index": ("workers", "shard_index"),
    "--encoder-threads": ("workers", "encoder_threads"),
}
SCENE_FLAGS: dict[str, tuple[str, str]] = {
    "--scene-frames": ("scenes", "frames"),
    "--chunk-frames": ("scenes", "chunk_frames"),
    "--scene-resolution": ("scenes", "resolution"),
    "--depth-resolution": ("scenes", "depth_resolution"),
    "--scene-fps": ("scenes", "fps"),
}
ENCODE_FLAGS.update(SCENE_FLAGS)
LONG_VIDEO_FLAGS = ("--split-scenes", "--min-scene-seconds", "--scene-threshold", "--clip-mode", "--clip-stride",
                    "--clips-per-scene", "--scene-captions")
# `diffprep raw`: the same flags without the encoders, workers and member names, plus the stored formats; the clip
# flags (--resolution-buckets: store clips) without the VAE's tiling.
RAW_FLAGS: dict[str, tuple[str, str]] = {
    **{flag: target for flag, target in ENCODE_FLAGS.items()
       if (target[0] not in ("model", "video", "workers") and flag not in ("--layout", "--key-map"))
       or flag in ("--resolution-buckets", "--target-fps", "--frame-sampling", *LONG_VIDEO_FLAGS)},
    "--layout": ("output", "layout"),  # raw: energon shards, or edm-zip (diffprep.encodings.edm_zip)
    "--image-format": ("raw", "image_format"),
    "--image-quality": ("raw", "image_quality"),
    "--video-crf": ("raw", "video_crf"),
    "--keep-audio": ("raw", "keep_audio"),
    "--prompts-only": ("raw", "prompts_only"),
}
# `diffprep ingest`: where the dataset goes, approvals and finalize; what to ingest is diffprep.tools.ingest_settings'.
INGEST_OUTPUT_FLAGS: dict[str, tuple[str, str]] = {
    flag: ENCODE_FLAGS[flag] for flag in ("--output-dir", "--output-s3-endpoint-url", "--output-s3-profile",
                                          "--on-existing", "--accept-rejects", "--approval-timeout", "--train-split",
                                          "--finalize", "--on-split-change")}
BOOLEAN_FLAGS = {"--hf-streaming", "--compress", "--center-crop", "--variable-size", "--finalize", "--vae-tiling",
                 "--skip-audio", "--load-text-encoder-in-8bit", "--keep-audio",
                 "--prompts-only", "--full-cov"}
LIST_FLAGS = {"--hf-data-files"}
APPEND_FLAGS = {"--score-column"}  # repeatable (each may also be a comma list)
# Flags whose value may be left out, and the value they then take: `--split-scenes` alone is PySceneDetect's own
# default detector.
OPTIONAL_VALUE_FLAGS = {"--split-scenes": "adaptive"}
# Second names of a flag: the LTX trainer's names for the metadata file's columns.
FLAG_ALIASES = {"--caption-key": ("--caption-column",), "--video-key": ("--video-column",)}


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, tuple[str, str]] = ENCODE_FLAGS,
                      config_help: str | None = None) -> None:
    from diffprep.config import SECTIONS

    sections = ", ".join(dict.fromkeys(section for section, _ in flags.values()))
    parser.add_argument("--config", help=(config_help or f"YAML config (sections used: {sections})").replace("%", "%%"))
    for flag, (section, key) in flags.items():
        info = SECTIONS[section].model_fields[key]
        help_text = f"{info.description} [{section}.{key}]".replace("%", "%%")  # argparse formats help with %
        dest = f"{section}.{key}"
        names = (flag, *FLAG_ALIASES.get(flag, ()))
        if flag in BOOLEAN_FLAGS:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif flag in APPEND_FLAGS:
            parser.add_argument(flag, dest=dest, action="append", default=argparse.SUPPRESS, help=help_text)
        elif flag in LIST_FLAGS:
            parser.add_argument(flag, dest=dest, nargs="+", default=argparse.SUPPRESS, help=help_text)
        elif flag in OPTIONAL_VALUE_FLAGS:
            parser.add_argument(*names, dest=dest, nargs="?", const=OPTIONAL_VALUE_FLAGS[flag],
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=help_text)


def overrides_from(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings the user typed, per section (pydantic converts the strings)."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if "." not in dest:
            continue
        section, key = dest.split(".", 1)
        overrides.setdefault(section, {})[key] = value
    return overrides
