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
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from diffprep.errors import ConfigError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["DEFAULT_INSTRUCTION", "DEFAULT_MODEL", "CaptionInput", "CaptionSettings", "Captioner",
           "TransformersCaptioner", "load_captioner"]

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"

# One paragraph, as the peers ask theirs: what is seen, what moves, where, and how it is filmed, with no preamble.
DEFAULT_INSTRUCTION = (
    "Describe this video in detail in one paragraph. Say who or what the main subjects are and what they look "
    "like, what they do and how they move, the setting and the background, the lighting and the colours, and how "
    "the camera frames them and moves. Describe only what can be seen, in plain prose, without a preamble, lists "
    "or speculation. If it is a single image, describe it the same way."
)


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
    seed: int = 0

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
            raise ConfigError(f"caption settings: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
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
    """Qwen2.5-VL (or a model with the same processor and chat template) in transformers, greedy, batched with
    left padding."""

    def __init__(self, settings: CaptionSettings, *, device: str = "cpu", token: str | None = None) -> None:
        self.settings = settings
        self.device = device
        raise NotImplementedError("the transformers captioner is being written (h-capmodel)")

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def caption(self, batch: list[CaptionInput]) -> list[str]:
        raise NotImplementedError

    def count_tokens(self, text: str) -> int:
        raise NotImplementedError


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
