"""The captioning models: a vision-language model in transformers, or an OpenAI-compatible server by URL.

:class:`CaptionSettings` holds everything that changes a caption's bytes (it is
recorded with the caption set); :func:`load_captioner` gives a
:class:`Captioner` for them:

- ``server_url`` unset: :class:`TransformersCaptioner`, Qwen2.5-VL through
  transformers' own classes (``AutoProcessor``, ``Qwen2_5_VLForConditionalGeneration``),
  the model found as the encoders are (a local folder, or a hub repo through
  :mod:`diffprep.families.hub`, so ``HF_HUB_OFFLINE`` and the token rules hold).
- ``server_url`` set: :class:`~diffprep.captions.server.ServerCaptioner`, the
  chat completions endpoint of vLLM or any OpenAI-compatible server
  (the LTX trainer's ``caption_videos.py`` way), ``model`` naming its model.

Captions are greedy (``do_sample=False``, temperature 0), so a sample's caption
is the same whatever batch it is in and whichever worker makes it; the tests
check it on the tiny model.

The defaults are the peers' (Cosmos-Curate and NeMo Curator caption with
Qwen2.5-VL-7B-Instruct, frames at 2 fps, at most 256 of them, 512 new tokens,
batches of 16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from diffprep.errors import ConfigError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["DEFAULT_INSTRUCTION", "DEFAULT_MODEL", "CaptionInput", "CaptionSettings", "Captioner",
           "TransformersCaptioner", "load_captioner"]

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"

# The curation peers' default captioning prompt (Cosmos-Curate, NeMo Curator; VILA's and Cosmos' papers use it too).
DEFAULT_INSTRUCTION = "Elaborate on the visual and narrative elements of the video in detail."


@dataclass(frozen=True)
class CaptionSettings:
    """How captions are made; every field is recorded with the caption set (each changes the captions' bytes)."""

    model: str = DEFAULT_MODEL  # hub id or local folder (transformers); with server_url, the server's model name
    server_url: str | None = None  # an OpenAI-compatible /v1 endpoint (vLLM); model names its model
    instruction: str = DEFAULT_INSTRUCTION
    max_new_tokens: int = 512
    fps: float = 2.0  # frames sampled per second of a clip
    max_frames: int = 256  # a clip's frames are capped (evenly spaced) at this
    batch_size: int = 16
    seed: int = 0  # greedy decoding draws nothing; recorded, and sent to a server as its request seed

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ConfigError("captions model is empty: give a hub id (Qwen/Qwen2.5-VL-7B-Instruct), a local folder "
                              "or, with a server URL, the name the server serves")
        if not self.instruction.strip():
            raise ConfigError("captions instruction is empty: give the prompt the model is asked with, or leave it "
                              "out for the default")
        for name, low in (("max_new_tokens", 1), ("max_frames", 1), ("batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"captions {name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(self.fps, (int, float)) and self.fps > 0):
            raise ConfigError(f"captions fps must be > 0, got {self.fps!r}")
        if self.server_url is not None and not self.server_url.startswith(("http://", "https://")):
            raise ConfigError(f"captions server_url must start with http:// or https:// (the server's /v1 "
                              f"endpoint, e.g. http://127.0.0.1:8000/v1), got {self.server_url!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaptionSettings:
        """Back from :meth:`to_json`; an unknown field is refused with the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"caption settings: unknown field(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**data)


@dataclass
class CaptionInput:
    """One sample as a captioner sees it."""

    key: str  # the sample's source id
    frames: list[Image.Image] = field(repr=False)  # one for an image, the sampled frames of a clip (RGB)
    fps: float | None = None  # the frames' rate for a clip, None for an image

    @property
    def is_video(self) -> bool:
        return self.fps is not None


class Captioner(Protocol):
    """What the caption flow calls; both backends are one."""

    settings: CaptionSettings

    def describe(self) -> dict[str, Any]:
        """The model (with its revision or files' hashes) and the settings, JSON-able, for the caption set."""
        ...

    def caption(self, batch: list[CaptionInput]) -> list[str]:
        """One caption per input, in order; greedy, so byte-identical whatever the batch."""
        ...

    def count_tokens(self, text: str) -> int:
        """The caption's length in the model's own tokens (may raise NotImplementedError)."""
        ...


def load_captioner(settings: CaptionSettings, device: str = "cpu", token: str | None = None) -> Captioner:
    """The captioner for ``settings``: the server's when ``server_url`` is set, else the transformers model on
    ``device`` (``token``: the Hugging Face token for a gated or private repo, as the encoders take it)."""
    if settings.server_url is not None:
        from diffprep.captions.server import ServerCaptioner

        return ServerCaptioner(settings)
    return TransformersCaptioner(settings, device=device, token=token)


class TransformersCaptioner:
    """Qwen2.5-VL (or a model with its processor and chat template) in transformers: greedy, batched with left
    padding.

    The inputs are made as ``Qwen2_5_VLProcessor`` makes them, from its parts
    loaded alone: the tokenizer (``AutoTokenizer``, padding on the left), the
    chat template, Qwen2-VL's image processor (its Pillow backend) and, for a
    clip, the arithmetic of Qwen2-VL's video processor (:func:`video_patches`).
    The processor class itself needs torchvision for its video part, which
    does not import beside this project's CPU torch; and made this way the
    inputs are the same on every worker, torchvision or not (the torchvision
    backend resizes with other filters). Each image's or clip's
    ``<|image_pad|>`` / ``<|video_pad|>`` is repeated once per merged patch, a
    clip tells the model its frames' times (``second_per_grid_ts``), and
    ``mm_token_type_ids`` marks the vision tokens for the 3-D positions, as the
    processor does.

    One ``caption`` call at a time per captioner: generate keeps the batch's
    position offsets (``rope_deltas``) on the model between its steps.
    """

    def __init__(self, settings: CaptionSettings, *, device: str = "cpu", token: str | None = None) -> None:
        import torch

        from diffprep.families.imports import family_imports

        self.settings = settings
        self.device = device
        self.part = _resolve_model(settings.model, token)
        folder = self.part.path
        with family_imports("qwen2.5-vl"):
            from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
        self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
        self.video = _video_settings(folder, self.image_processor)
        self.chat_template = _chat_template(folder, self.tokenizer)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(self.tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(self.video_token)

    def describe(self) -> dict[str, Any]:
        return {"backend": "transformers", "model": self.part.identity(),
                "class": type(self.model).__name__, "dtype": str(self.model.dtype).removeprefix("torch."),
                "video_inputs": "diffprep.captions.models.video_patches (Qwen2-VL video processor arithmetic, "
                                "Pillow bicubic)", "video_processor": self.video,
                "settings": self.settings.to_json()}

    def prompt(self, item: CaptionInput) -> str:
        """The chat-templated prompt of one input, its vision span not yet expanded."""
        content = [{"type": "video" if item.is_video else "image"},
                   {"type": "text", "text": self.settings.instruction}]
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)

    def inputs(self, batch: list[CaptionInput]) -> dict[str, Any]:
        """The model's inputs for ``batch`` (what ``processor(text=..., images=..., videos=...)`` returns)."""
        import torch

        for item in batch:
            if not item.frames or (not item.is_video and len(item.frames) != 1):
                raise ConfigError(f"{item.key}: a caption input holds one frame for an image (fps None) or the "
                                  f"frames of a clip (with its fps), got {len(item.frames)} frames and fps "
                                  f"{item.fps}; make it with diffprep.captions.frames.caption_input")
        texts: list[str] = []
        images = [item.frames[0] for item in batch if not item.is_video]
        image_inputs = self.image_processor(images=images, return_tensors="pt") if images else {}
        videos = [video_patches(item, self.video) for item in batch if item.is_video]
        merge = self.image_processor.merge_size ** 2
        image_i = video_i = 0
        for item in batch:
            text = self.prompt(item)
            if item.is_video:
                count = videos[video_i][1].prod().item() // self.video["merge_size"] ** 2
                text = text.replace(self.video_token, self.video_token * count, 1)
                video_i += 1
            else:
                count = image_inputs["image_grid_thw"][image_i].prod().item() // merge
                text = text.replace(self.image_token, self.image_token * count, 1)
                image_i += 1
            texts.append(text)
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        ids = encoded["input_ids"]
        inputs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": encoded["attention_mask"],
            "mm_token_type_ids": (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int(),
        }
        if images:
            inputs |= {"pixel_values": image_inputs["pixel_values"], "image_grid_thw": image_inputs["image_grid_thw"]}
        if videos:
            inputs |= {"pixel_values_videos": torch.cat([patches for patches, _grid, _s in videos]),
                       "video_grid_thw": torch.stack([grid for _p, grid, _s in videos]),
                       "second_per_grid_ts": torch.tensor([seconds for _p, _g, seconds in videos])}
        return inputs

    def caption(self, batch: list[CaptionInput]) -> list[str]:
        import torch

        if not batch:
            return []
        inputs = {name: value.to(self.device) for name, value in self.inputs(batch).items()}
        for name in ("pixel_values", "pixel_values_videos"):
            if name in inputs:
                inputs[name] = inputs[name].to(self.model.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, do_sample=False, num_beams=1,
                                      max_new_tokens=self.settings.max_new_tokens)
        new = out[:, inputs["input_ids"].shape[1]:]
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return [text.strip() for text in texts]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def video_patches(item: CaptionInput, video: dict[str, Any]) -> tuple[Any, Any, float]:
    """A clip's ``(pixel_values_videos, video_grid_thw, second_per_grid_ts)`` as Qwen2-VL's video processor makes
    them with ``cap_pixels_per_frame=True`` (qwen-vl-utils' budget, transformers' default from v5.22).

    Every frame is resized to one size (``smart_resize``: sides multiples of patch x merge, the pixels between
    the processor's bounds, at most an even share of 90% of ``max_video_tokens`` per frame), scaled to [0, 1],
    normalized; the frame count is padded to a multiple of the temporal patch with the last frame; the patches
    are laid out (t, h-block, w-block, h-merge, w-merge, channel, temporal, patch row, patch column).
    """
    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sizes = {frame.size for frame in item.frames}
    if len(sizes) != 1:
        raise ConfigError(f"{item.key}: a clip's frames must all have one size, got {sorted(sizes)}")
    (width, height), = sizes
    patch, merge, temporal = video["patch_size"], video["merge_size"], video["temporal_patch_size"]
    factor = patch * merge
    shortest, longest = video["size"]["shortest_edge"], video["size"]["longest_edge"]
    total = int(video.get("max_video_tokens", 128000) * factor * factor * 0.9)
    max_pixels = max(min(longest, total * temporal // len(item.frames)), int(shortest * 1.05))
    new_h, new_w = smart_resize(height, width, factor=factor, min_pixels=shortest, max_pixels=max_pixels)
    mean = np.asarray(video["image_mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(video["image_std"], dtype=np.float32)[:, None, None]
    # Rescaled in float64 and then cast, as transformers' image_transforms.rescale does: the same float32 values.
    frames = [((np.asarray(frame.convert("RGB").resize((new_w, new_h), Image.Resampling.BICUBIC))
                .transpose(2, 0, 1).astype(np.float64) * video["rescale_factor"]).astype(np.float32) - mean) / std
              for frame in item.frames]
    frames += [frames[-1]] * (-len(frames) % temporal)
    grid_t, grid_h, grid_w = len(frames) // temporal, new_h // patch, new_w // patch
    stacked = np.stack(frames).reshape(grid_t, temporal, 3, grid_h // merge, merge, patch, grid_w // merge, merge,
                                       patch)
    flat = stacked.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t * grid_h * grid_w,
                                                                3 * temporal * patch * patch)
    return torch.from_numpy(np.ascontiguousarray(flat)), torch.tensor([grid_t, grid_h, grid_w]), temporal / item.fps


def _resolve_model(model: str, token: str | None):
    """The model's folder (a local one, or the hub repo's root files through the encoders' resolution) as a
    :class:`~diffprep.families.hub.ResolvedPart`, whose ``identity()`` the caption set records."""
    from pathlib import Path

    from diffprep.errors import OfflineError
    from diffprep.families.hub import ResolvedPart, resolve_component

    try:
        local_dir, subfolder = resolve_component(model, None, token=token, encoder="captioner")
    except OfflineError as exc:
        raise OfflineError(
            f"captioner: {model} is not in the Hugging Face cache and the hub cannot be reached (or HF_HUB_OFFLINE "
            f"is set). Fix it in one of three ways:\n  1. give a local folder holding the model as the captions "
            f"model\n  2. download it into the cache once: `hf download {model}` (the same HF_HOME as this run)\n"
            "  3. go online (unset HF_HUB_OFFLINE)", encoder="captioner", repo_id=model, revision=None,
        ) from exc.__cause__
    is_local = Path(model).expanduser().is_dir()
    commit = local_dir.name if not is_local and local_dir.parent.name == "snapshots" else None
    part = ResolvedPart(name="captioner", source=str(local_dir) if is_local else model, revision=None, commit=commit,
                        local_dir=local_dir, subfolder=subfolder)
    if not (part.path / "config.json").is_file():
        raise ConfigError(f"captioner: {part.path} has no config.json; give the folder of a Qwen2.5-VL model")
    return part


def _chat_template(folder: Any, tokenizer: Any) -> str:
    """The model's chat template: chat_template.jinja, else chat_template.json (older hub repos), else the
    tokenizer's own."""
    import json

    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ConfigError(f"captioner: {folder} has no chat template (chat_template.jinja or chat_template.json); "
                      "give the folder of an instruction-tuned model (Qwen/Qwen2.5-VL-7B-Instruct)")


def _video_settings(folder: Any, image_processor: Any) -> dict[str, Any]:
    """The video processor's settings: video_preprocessor_config.json, else Qwen2-VL's video defaults with the
    image processor's patch sizes and normalization (the hub's Qwen2.5-VL repos have no video config)."""
    import json

    settings: dict[str, Any] = {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "patch_size": image_processor.patch_size, "merge_size": image_processor.merge_size,
        "temporal_patch_size": image_processor.temporal_patch_size, "rescale_factor": image_processor.rescale_factor,
        "image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std),
        "max_video_tokens": 128000,
    }
    path = folder / "video_preprocessor_config.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        settings |= {name: saved[name] for name in settings if name in saved}
        if "min_pixels" in saved or "max_pixels" in saved:  # the older spelling of the size bounds
            settings["size"] = {"shortest_edge": saved.get("min_pixels", settings["size"]["shortest_edge"]),
                                "longest_edge": saved.get("max_pixels", settings["size"]["longest_edge"])}
    return settings

