"""The settings' sections, every setting with its description (which the CLI help and the Prefect UI form read).

(Over 400 lines on purpose: the sections stay in one file so every setting's meaning is in one place.)
``diffprep.config`` builds ``Settings`` from them and loads it: defaults < YAML < environment < parameters.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffprep.config.files import refuse_unexpanded
from diffprep.config.scenes import scene_threshold

CIFAR10_SIDE = 32  # the CIFAR-10 release's images (diffprep.sources.cifar10): a cifar10 run's default size

SourceType = Literal["directory", "huggingface", "webdataset", "metadata", "imagefolder", "cifar10", "scenes"]
Precision = Literal["bf16", "fp16", "fp32"]
LatentMode = Literal["sample", "mode", "posterior"]
OnExisting = Literal["resume", "overwrite", "abort", "new-dir", "reuse"]
OnSplitChange = Literal["replace", "keep", "abort"]
RawImageFormat = Literal["jpg", "png", "webp"]
FamilyName = Literal["flux", "wan", "ltx2", "sd-vae"]
FrameSampling = Literal["head", "uniform", "progressive"]
SceneFormat = Literal["re10k", "dl3dv", "scannetpp", "mvssynth", "nerfstudio", "colmap"]
# How the samples are laid out on disk (diffprep.writer.layouts): energon = shards under diffprep's own field names;
# fastgen = shards under FastGen's member names; ltx = the LTX-2 trainer's .precomputed/ folders (LTX-2 only).
Layout = Literal["energon", "fastgen", "ltx", "edm-zip", "gae"]
Crop = Literal["edm", "adm"]

DEFAULT_MODEL = "black-forest-labs/FLUX.1-dev"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Each source type's location field: the one that names where its samples are.
SOURCE_LOCATIONS: dict[str, str] = {"directory": "input_dir", "huggingface": "hf_dataset",
                                    "webdataset": "input_path", "metadata": "metadata_file"}
# Every source type's location field; imagefolder reads input_dir too, so it is never inferred from a location.
SOURCE_NEEDS: dict[str, str] = {**SOURCE_LOCATIONS, "imagefolder": "input_dir", "cifar10": "input_path",
                                "scenes": "input_dir"}


class SourceConfig(_Section):
    type: SourceType | None = Field(
        None, description="Where samples come from: directory | huggingface | webdataset | metadata | imagefolder "
        "(class folders, ImageNet's train/ layout: give it explicitly) | cifar10 (cifar-10-python.tar.gz at "
        "--input-path: give it explicitly). Unset: the "
        "one whose location is given (--input-dir, --hf-dataset, --input-path, --metadata-file).",
    )
    input_dir: str | None = Field(
        None, description="directory: a folder (or s3://bucket/prefix) with images/ and/or videos/, and captions/, "
        "paired by file stem. imagefolder: a folder of class folders (<class>/<image>, any depth)."
    )
    hf_dataset: str | None = Field(None, description="huggingface: hub name or local path of the dataset.")
    hf_split: str = Field("train", description="huggingface: split to read.")
    hf_data_files: str | list[str] | None = Field(None, description="huggingface: data files within the dataset.")
    hf_revision: str | None = Field(None, description="huggingface: dataset revision (branch, tag or commit).")
    hf_streaming: bool = Field(False, description="huggingface: stream rows instead of preparing the dataset locally.")
    image_key: str | None = Field(
        None, description="Column (or dotted path) holding the image; auto-detected when unset."
    )
    caption_key: str | None = Field(
        None, description="Column (or dotted path, e.g. json.prompt) holding the caption; auto-detected when unset."
    )
    # Video sources: a metadata file (the LTX trainer's dataset.json convention) and the clip's column or member.
    metadata_file: str | None = Field(
        None, description="metadata: a JSON list, JSONL or CSV file (local or s3://) with a caption column and a "
        "video / media_path / image column (LTX-2 audio only: an audio column); paths are relative to the file's "
        "folder.",
    )
    video_key: str | None = Field(
        None, description="Column (metadata, huggingface) or tar extension (webdataset) holding the clip; "
        "auto-detected when unset.",
    )
    audio_key: str | None = Field(
        None, description="metadata: the column of audio files (wav, flac, mp3, m4a, or a clip's sound) of an "
        "audio-only LTX-2 run (T2A, with --audio-durations); default audio when the file has no video, media_path "
        "or image column.",
    )
    reference_key: str | None = Field(
        None, description="metadata: the column naming each clip's IC-LoRA reference clip (LTX-2); default "
        "reference_video or ref_media_path when the file has one.",
    )
    depth_key: str | None = Field(
        None, description="metadata: the column naming each clip's depth clip (Wan: depth_latent.pth, FastGen's VACE "
        "v2v depth_latent), e.g. depth_path; decoded with the clip's frames, crop and size.",
    )
    caption_template: str | None = Field(
        None, description="huggingface, imagefolder, cifar10: a caption made from a class label, e.g. 'a photo of "
        "a {label}' ({label}: the class name). Unset: the class name alone. Text captions are kept as they are.",
    )
    class_names: str | None = Field(
        None, description="huggingface: a file with one class name per line (label 0 first), for an integer label "
        "column that is not a datasets ClassLabel (a ClassLabel's own names are used otherwise). imagefolder: one "
        "name per class folder in sorted order (unset: ImageNet-1k's names when every folder is one of its synset "
        "ids, else the folders'). cifar10: its 10 names, label 0 first (unset: CIFAR-10's own).",
    )
    input_path: str | None = Field(
        None, description="webdataset: a glob of tar shards, e.g. /data/shards/*.tar or s3://bucket/shards/*.tar. "
        "cifar10: the cifar-10-python.tar.gz release file."
    )
    num_classes: int | None = Field(
        None, ge=1, description="edm-zip: the label width the trainer must see (FastGen takes max(label)+1): 10 for "
        "CIFAR-10, 1000 for ImageNet. Validation refuses an archive whose labels give another width. Unset: the "
        "source's own count where it knows it (class folders, CIFAR-10, a ClassLabel column). Refused when the source "
        "knows another count or has no labels.",
    )
    score_columns: list[str] | None = Field(
        None, description="metadata: columns of numbers copied into each sample's json / meta.json as top-level "
        "fields, e.g. aesthetic_score (FastGen's presets_filter score_key); repeat the flag or separate names by "
        "commas. A row without a value (absent, empty, null, NaN) leaves the field out; any other non-number is the "
        "reject invalid_score.",
    )
    scene_format: SceneFormat | None = Field(
        None, description="scenes: the layout of the posed scenes under --input-dir: re10k | dl3dv | scannetpp | "
        "mvssynth | nerfstudio | colmap (docs/sources/scenes.md names each one's files).",
    )
    pose_key: Literal["pose", "aligned_pose"] = Field(
        "pose", description="scenes, scannetpp: which camera-to-world of pose_intrinsic_imu.json to read.",
    )
    cifar_split: Literal["train", "test"] = Field(
        "train", description="cifar10: train (data_batch_1..5, 50,000 images) or test (test_batch, 10,000)."
    )
    s3_endpoint_url: str | None = Field(
        None, description="s3:// sources: endpoint of a non-AWS store (MinIO, Ceph, R2), e.g. http://minio:9000. "
        "Unset: AWS, or AWS_ENDPOINT_URL. Credentials come from the AWS chain (env, profile, instance role).",
    )
    s3_profile: str | None = Field(
        None, description="s3:// sources: AWS profile (~/.aws/config) for credentials and region. Unset: "
        "AWS_PROFILE or the default chain.",
    )

    _paths_expanded = field_validator("input_dir", "hf_dataset", "metadata_file", "class_names",
                                      "input_path")(refuse_unexpanded)

    @field_validator("score_columns", mode="before")
    @classmethod
    def _split_score_columns(cls, value: Any) -> Any:
        """``a,b`` (a flag, an environment variable) or repeated flags -> the names, in order, each once."""
        if value is None:
            return None
        parts = [value] if isinstance(value, str) else list(value)
        names = [name.strip() for part in parts for name in str(part).split(",") if name.strip()]
        return list(dict.fromkeys(names)) or None

    @model_validator(mode="before")
    @classmethod
    def _type_from_location(cls, data: Any) -> Any:
        """An unset type is the one whose location alone is given (``--input-dir`` alone: a directory)."""
        if isinstance(data, dict) and data.get("type") is None:
            given = [kind for kind, field in SOURCE_LOCATIONS.items() if data.get(field)]
            if len(given) == 1:
                data = {**data, "type": given[0]}
        return data


class OutputConfig(_Section):
    output_dir: str | None = Field(
        None, description="Destination of the dataset (created if missing): a folder, or s3://bucket/prefix "
        "(staged in $DIFFPREP_STAGING_DIR, default ~/.cache/diffprep/staging).",
    )
    s3_endpoint_url: str | None = Field(
        None, description="s3:// output: endpoint of a non-AWS store (MinIO, Ceph, R2). Unset: AWS, or "
        "AWS_ENDPOINT_URL. Credentials come from the AWS chain (env, profile, instance role).",
    )
    s3_profile: str | None = Field(
        None, description="s3:// output: AWS profile (~/.aws/config) for credentials and region. Unset: "
        "AWS_PROFILE or the default chain.",
    )
    shard_size: int = Field(1000, ge=1, le=1_000_000, description="Samples per tar shard (one work unit).")
    max_samples: int | None = Field(None, ge=1, description="Stop after this many source samples (smoke tests).")
    compress: bool = Field(False, description="Gzip the shards. Refused: Energon indexes uncompressed tars only.")
    on_existing: OnExisting | None = Field(
        None,
        description="When the output holds data this run would change: resume (same settings only) | new-dir | "
        "overwrite | reuse (keep it as it is, encode nothing) | abort. Unset: ask.",
    )
    accept_rejects: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Accept up to this fraction of rejected samples without asking (0.01 = 1%).",
    )
    approval_timeout: int = Field(
        3600, ge=10, le=7 * 24 * 3600,
        description="Seconds a paused run waits for an answer in the Prefect UI; then it stops, changing nothing.",
    )
    layout: Layout = Field(
        "energon", description="energon: WebDataset shards finalized for Megatron-Energon, under diffprep's member "
        "names (latents.pth, prompt_embeds.pth, ...) | fastgen: the same shards under NVIDIA FastGen's latent "
        "loaders' names (latent.pth, txt_emb.pth, plus neg_prompt_emb.npy and shard_counts.json at the top) | ltx: "
        "the LTX-2 trainer's <output_dir>/.precomputed/ folders (latents/, conditions/, audio_latents/, "
        "reference_latents/), one .pt per sample named after its media path (LTX-2, metadata source) | edm-zip: "
        "one stored ZIP (dataset.zip) as EDM's dataset_tool writes it and FastGen's ImageFolderDataset reads it "
        "(raw png: NNNNN/imgNNNNNNNN.png + dataset.json labels), assembled from the committed shards at finalize.",
    )
    key_map: dict[str, str] | None = Field(
        None, description="Other member names for some fields, e.g. 'latents=latent.pth,prompt_embeds=txt_emb.pth' "
        "(a mapping in YAML): field -> name, the field's own extension kept. Not with layout fastgen (a preset).",
    )

    _paths_expanded = field_validator("output_dir")(refuse_unexpanded)

    @field_validator("key_map", mode="before")
    @classmethod
    def _parse_key_map(cls, value: Any) -> Any:
        """``field=name,field=name`` (a flag, an environment variable) -> a mapping; a mapping stays as it is."""
        if not isinstance(value, str):
            return value
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        bad = [entry for entry in entries if entry.count("=") != 1 or not all(p.strip() for p in entry.split("="))]
        if bad or not entries:
            raise ValueError(f"key_map entries must be field=name separated by commas, e.g. "
                             f"'latents=latent.pth,prompt_embeds=txt_emb.pth'; cannot read {bad or value!r}")
        pairs = [tuple(part.strip() for part in entry.split("=")) for entry in entries]
        fields = [field for field, _ in pairs]
        twice = sorted({field for field in fields if fields.count(field) > 1})
        if twice:
            raise ValueError(f"key_map names the field(s) {twice} more than once")
        return dict(pairs)

    @model_validator(mode="after")
    def _one_layout(self) -> OutputConfig:
        if self.key_map and self.layout != "energon":
            raise ValueError(f"layout {self.layout!r} is a preset key map: pass it or key_map, not both")
        return self


class ModelConfig(_Section):
    model_path: str = Field(
        DEFAULT_MODEL, description="Hub repo or local folder in the model family's diffusers layout (FLUX.1-dev, "
        "Wan2.1-T2V-...-Diffusers)."
    )
    family: FamilyName | None = Field(
        None, description="Model family: flux | wan | ltx2. Unset: read from model_path (model_index.json's "
        "_class_name; an LTX-2 checkpoint's safetensors config)."
    )
    text_encoder_path: str | None = Field(
        None, description="LTX-2: the Gemma 3 folder. Unset: the Gemma folder inside model_path (the layout "
        "`diffprep tiny-model --family ltx2` writes).",
    )
    load_text_encoder_in_8bit: bool = Field(
        False, description="LTX-2: Gemma's Linear layers in bitsandbytes int8 (threshold 6.0), as the trainer's "
        "flag: about half the text encoder's memory (benchmarks/README.md); the features differ slightly.",
    )
    lora_trigger: str | None = Field(
        None, description="LTX-2: a trigger word put before every caption ('T ' + caption), as the trainer does.",
    )
    revision: str | None = Field(None, description="Hub revision of model_path (branch, tag or commit).")
    vae_path: str | None = Field(None, description="Override for the VAE (a folder holding the AutoencoderKL).")
    t5_path: str | None = Field(
        None, description="Override for T5 (a folder with text_encoder_2/ and tokenizer_2/, or the model itself)."
    )
    clip_path: str | None = Field(
        None, description="Override for CLIP (a folder with text_encoder/ and tokenizer/, or the model itself)."
    )
    precision: Precision = Field("bf16", description="Encoder and stored tensor precision.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N.")
    batch_size: int = Field(8, ge=1, le=4096, description="Samples per encoder batch.")
    t5_max_length: int = Field(512, ge=1, le=512, description="T5 tokens (512 for FLUX.1-dev, 256 for schnell).")
    latent_mode: LatentMode = Field(
        "sample", description="sample: draw from the VAE posterior, seeded by the sample key; mode: its mean; "
        "posterior: its mean as latents, plus the raw posterior (mean.pth, logvar.pth) for a trainer that draws a "
        "fresh latent every epoch (Primus vae_latent_mode: resample)."
    )
    text_cache_mib: int = Field(
        4096, ge=0, le=1024 * 1024,
        description="Memory per worker process for text encodings kept by caption, so each distinct caption is "
        "encoded once (class-label datasets: almost all text-encoder work). 4096 MiB holds 1,000 FLUX.1-dev T5 "
        "embeddings in bf16; 0 turns the cache off. The bytes written are the same either way.",
    )
    negative_prompt: str | None = Field(
        None, description="layout fastgen: the text whose embeddings are written to neg_prompt_emb.npy (FastGen's "
        "neg_condition through files_map). Unset: the empty caption.",
    )
    min_psnr: float = Field(
        20.0, ge=0.0,
        description="Sanity check: the median VAE round-trip PSNR (dB) of the first batch must reach this; a "
        "correctly configured Flux VAE scores about 30. 0 turns the check off (random-weight test models).",
    )

    _paths_expanded = field_validator("model_path", "text_encoder_path", "vae_path", "t5_path",
                                      "clip_path")(refuse_unexpanded)


class ImageConfig(_Section):
    image_size: int = Field(1024, ge=16, le=8192, description="Square output size (fixed-size mode), a multiple of 16. "
                            "Unset: 32 for a cifar10 source (its own size), else 1024.")
    center_crop: bool = Field(
        True, description="Fixed size: resize the short side then crop the center. Off: stretch to a square."
    )
    variable_size: bool = Field(
        False, description="Keep the aspect ratio: longest side to max_size, sides multiples of 16."
    )
    max_size: int = Field(1024, ge=16, le=8192, description="Longest side in variable-size mode.")
    max_pixels: int = Field(
        89_478_485, ge=1, description="Decompression-bomb limit: images with more pixels are rejected."
    )
    min_size: int | None = Field(
        None, ge=1, le=8192, description="Reject images whose shorter side (upright) is below this many pixels "
        "(image_too_small). Unset: every size is kept; an upscaled image is counted as the note image_upscaled.",
    )
    crop: Crop | None = Field(
        None, description="Fixed size, as the tools FastGen's recipes run: edm (square centre crop, then Lanczos to "
        "image_size: EDM's center-crop) | adm (box-halve while the short side is >= 2x image_size, bicubic to it, "
        "centre crop: EDM2's center-crop-dhariwal). Unset: diffprep's own resize-then-crop.",
    )
    background: tuple[int, int, int] = Field(
        (255, 255, 255), description="RGB colour that transparent pixels are composited on."
    )
    decode_workers: int = Field(2, ge=1, le=64, description="Threads decoding images while the encoders run.")
    buckets: str | None = Field(
        None, description="Aspect-ratio buckets instead of one square size: 'auto' (41 aspect ratios from 1:4 to 4:1 "
        "at the area image_size², sides multiples of 16) or 'WxH,WxH,...'. Each image goes to the bucket of nearest "
        "aspect ratio, resized to cover it and centre-cropped; a shard holds one bucket.",
    )

    @model_validator(mode="after")
    def _multiples_of_16(self) -> ImageConfig:
        if self.image_size % 16:
            raise ValueError(f"image_size must be a multiple of 16, got {self.image_size}")
        if self.max_size % 16:
            raise ValueError(f"max_size must be a multiple of 16, got {self.max_size}")
        if self.crop and (self.variable_size or self.buckets or not self.center_crop):
            raise ValueError(f"crop {self.crop!r} makes one square image_size: it takes no variable_size, buckets "
                             "or center_crop off")
        if self.buckets and self.variable_size:
            raise ValueError("buckets and variable_size are two ways to keep the aspect ratio: choose one")
        return self


class VideoConfig(_Section):
    resolution_buckets: str | None = Field(
        None,
        description="Output sizes WxHxF separated by ';' (the LTX trainer's syntax). A video family: W and H "
        "multiples of the VAE's spatial factor, F = 4k+1 for Wan (unset: 832x480x81;480x832x81). `diffprep raw`: "
        "set, it stores clips (W and H even); unset, images. A clip goes to the bucket of nearest aspect ratio "
        "among those it has enough frames for; an image to an F = 1 bucket.",
    )
    target_fps: float | None = Field(
        None, gt=0, description="Resample clips to this frame rate by timestamp. Unset: keep the source frames."
    )
    frame_sampling: FrameSampling = Field(
        "head", description="Which F frames of a longer clip: head (the first F) | uniform (spread over the clip)."
    )
    split_scenes: Literal["content", "adaptive", "threshold", "histogram"] | None = Field(
        None, description="Long videos: cut each clip at its shot boundaries (PySceneDetect's detector of this name, "
        "found once in the plan; the flag alone: adaptive, PySceneDetect's default, which finds hard cuts between "
        "flat colours that content misses) and take many windows per shot (--clip-mode). Unset: one clip per file.",
    )
    min_scene_seconds: float = Field(
        0.5, ge=0, description="--split-scenes: the shortest shot, in seconds: the detector places no cut sooner "
        "than this after the previous one.",
    )
    scene_threshold: float | None = Field(
        None, description="--split-scenes: the detector's threshold in its own units (unset: PySceneDetect's "
        "default): content 27 (mean HSV change, 0-255; lower finds more cuts), adaptive 3 (times its neighbours' "
        "change), threshold 12 (black level, 0-255), histogram 0.2 (luma histogram correlation, -1..1; higher finds "
        "more cuts).",
    )
    clip_mode: Literal["head", "chain", "slide", "uniform"] = Field(
        "chain", description="--split-scenes: the windows of each shot: head (the first) | chain (back to back) | "
        "slide (one every --clip-stride frames) | uniform (--clips-per-scene spread evenly).",
    )
    clip_stride: int | None = Field(
        None, ge=1, description="--clip-mode slide: frames between window starts (unset: the window's length).",
    )
    clips_per_scene: int = Field(1, ge=1, description="--clip-mode uniform: windows per shot.")
    scene_captions: str | None = Field(
        None, description="--split-scenes: a JSON file of captions by shot, {\"<source id>#<shot>\": caption} (or "
        "by clip id, <source id>#<shot>:<first>-<last>, for one window); every other clip has its source's caption.",
    )
    skip_audio: bool = Field(
        False, description="LTX-2: video latents and text only, no audio latents (the clips' audio is not read).",
    )
    audio_durations: str | None = Field(
        None, description="LTX-2 audio only (T2A): duration buckets in seconds separated by ';', e.g. '2.0;4.0'. "
        "Each file goes to the longest bucket not longer than its audio and is trimmed to it; one shorter than "
        "every bucket is the reject too_short_audio. Needs a metadata file with an audio column.",
    )
    reference_downscale_factor: int = Field(
        1, ge=1, le=16, description="LTX-2 IC-LoRA: reference clips are encoded at (F, H/N, W/N) of the (single) "
        "bucket; the scaled sides must stay multiples of 32.",
    )
    vae_tiling: bool = Field(
        False, description="Encode each frame in overlapping tiles (long 720p clips on a small GPU); the latents "
        "differ slightly from untiled ones.",
    )

    @model_validator(mode="after")
    def _scene_threshold_in_range(self) -> VideoConfig:
        """--scene-threshold is in its detector's own units: out of range, the settings are refused before anything
        starts (``scene_threshold``'s ConfigError names the range and the default)."""
        if self.split_scenes is not None:
            scene_threshold(self.split_scenes, self.scene_threshold)
        return self


class SceneConfig(_Section):
    """How a posed scene (``--source-type scenes``) becomes a sample: its frames, chunks and size."""

    frames: int | None = Field(
        None, ge=1, description="Frames kept per scene (--frame-sampling uniform | progressive | head); a scene with "
        "fewer is the reject too_few_frames. Unset: every frame.",
    )
    chunk_frames: int | None = Field(
        400, ge=2, description="Scenes longer than this are cut into chunk_NNN samples of this many frames (a tail "
        "under half of it joins the last chunk), each with its own caption. Unset: never cut.",
    )
    resolution: int | None = Field(
        None, ge=2, description="Centre square crop, then resize to S x S (K follows). Unset: the frames' own size.",
    )
    depth_resolution: int = Field(192, ge=1, description="Depth sources: the stored depth maps' side (nearest).")
    fps: float = Field(15.0, gt=0, description="The frame rate a scene's video.mp4 is stored at.")


class RawConfig(_Section):
    image_format: RawImageFormat = Field("jpg", description="Raw pipeline: file format of the stored images. Unset: "
                                         "png with layout edm-zip (EDM's archive holds PNGs only), else jpg.")
    image_quality: int = Field(
        95, ge=1, le=100, description="Raw pipeline: jpg/webp quality, 1-100 (ignored for png, which is lossless)."
    )
    video_crf: int = Field(
        18, ge=0, le=51, description="Raw pipeline, clips: x264's constant quality for the stored H.264 mp4, 0-51 "
        "(lower: better and larger; 18 looks lossless to most eyes).",
    )
    prompts_only: bool = Field(
        False, description="Raw pipeline: store only each sample's caption (txt, plus a json of its source id and "
        "scores), no media, for FastGen's PromptLoaderConfig (backward simulation); any source with captions. The "
        "media is read by the source but never decoded.",
    )
    keep_audio: bool = Field(
        False, description="Raw pipeline, clips: keep each clip's audio track in its mp4 (stereo AAC, trimmed to the "
        "kept frames: F / fps seconds), as FastGen's VideoAudioLoaderConfig reads it; a clip without one is the "
        "reject no_audio_stream.",
    )


class FinalizeConfig(_Section):
    enabled: bool = Field(True, description="Finalize (Energon metadata + validation) after encoding.")
    full_cov: bool = Field(
        False, description="Latent statistics with the full channel covariance (cov, ZCA whiten/unwhiten, the "
        "condition number) in .diffprep/latent_stats.pt: each unit also accumulates its float64 co-moments while "
        "it encodes, merged at finalize (no second pass). Unset: per-channel mean/std, merged the same way.",
    )
    train_split: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of shards for train; the rest is split evenly into val and test."
    )
    shuffle_seed: int = Field(42, description="Seed for assigning new shards to splits.")
    workers: int = Field(2, ge=1, le=256, description="Processes for Energon prepare.")
    on_split_change: OnSplitChange | None = Field(
        None, description="When the output is already split with another train_split: replace (moves shards) | "
        "keep | abort. Unset: ask.",
    )


class AuthConfig(_Section):
    hf_token_file: str | None = Field(
        None, description="File holding a Hugging Face token (mode 600 or 400). Empty: none (HF_TOKEN, or the "
        "cached login).",
    )
    hf_credentials_block: str | None = Field(
        None, description="Name of a saved diffprep Hugging Face credentials block (Prefect runs)."
    )
    aws_credentials_block: str | None = Field(
        None, description="Name of a saved diffprep S3 credentials block (Prefect runs): the keys for s3:// "
        "sources and outputs. Unset: the AWS chain (env, profile, instance role).",
    )

    @field_validator("hf_token_file", mode="before")
    @classmethod
    def _empty_is_no_file(cls, value: Any) -> Any:
        """``hf_token_file: ""`` means no token file (Primus's configs write it so for public datasets)."""
        return None if isinstance(value, str) and not value.strip() else value

    _paths_expanded = field_validator("hf_token_file")(refuse_unexpanded)


class WorkersConfig(_Section):
    devices: str | None = Field(
        None,
        description="One encode process per device: '0,1,2,3' (CUDA indices), 'auto' (every visible GPU), "
        "'cpu:N' (N CPU processes). Unset: one worker in the flow's process on model.device.",
    )
    deployment: str | None = Field(
        None,
        description="Fan units out to a work pool: the encode-units deployment to run, e.g. "
        "'encode-units/encode-units'. The output must be on storage every worker reaches.",
    )
    chunks: int | None = Field(
        None, ge=1, le=10_000, description="With deployment: how many encode-units runs to split the units into."
    )
    num_shards: int | None = Field(
        None, ge=1, description="Manual distribution (SLURM arrays, torchrun): this run encodes only units "
        "u % num_shards == shard_index, then stops; a later plain run audits and finalizes.",
    )
    shard_index: int | None = Field(None, ge=0, description="This run's index, 0 <= shard_index < num_shards.")
    encoder_threads: int | None = Field(
        None, ge=1, le=4096, description="CPU encoding: torch's intra-op threads every encoding process uses "
        "(a latent's last bits depend on it), recorded in the plan; a resume keeps the plan's. "
        "Unset: the planning machine's physical cores.",
    )

    @model_validator(mode="after")
    def _shards_together(self) -> WorkersConfig:
        if (self.num_shards is None) != (self.shard_index is None):
            raise ValueError("num_shards and shard_index go together: pass both or neither")
        if self.num_shards is not None and self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index must be < num_shards ({self.num_shards}), got {self.shard_index}")
        return self


SECTIONS: dict[str, type[_Section]] = {
    "source": SourceConfig,
    "output": OutputConfig,
    "model": ModelConfig,
    "image": ImageConfig,
    "video": VideoConfig,
    "scenes": SceneConfig,
    "raw": RawConfig,
    "finalize": FinalizeConfig,
    "auth": AuthConfig,
    "workers": WorkersConfig,
}
