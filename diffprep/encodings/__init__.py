"""What a pipeline stores per sample, by Energon subflavor name: pre-encoded Flux, raw images, pre-encoded Wan and
LTX-2 (video, and audio only), raw video, captions only, and datasets encoded elsewhere and ingested as stored."""

from typing import Any

from diffprep import contract
from diffprep.encodings.base import Encoding, SampleFields
from diffprep.encodings.ingested import Ingested
from diffprep.encodings.ltx2 import Ltx2
from diffprep.encodings.ltx2_audio import Ltx2Audio
from diffprep.encodings.preencoded import Preencoded
from diffprep.encodings.prompts import Prompts
from diffprep.encodings.raw import Raw
from diffprep.encodings.raw_video import RawVideo
from diffprep.encodings.scenes import Scenes
from diffprep.encodings.scenes_wan import WanScenes
from diffprep.encodings.sd_vae import SdVaeLatents
from diffprep.encodings.wan import Wan
from diffprep.errors import ConfigError

# Ltx2 before Wan: encoding_of_sample asks in this order, and an LTX-2 sample also has Wan's latents field (the
# scene encodings first: their samples also have Wan's and raw video's fields).
ENCODINGS: dict[str, Encoding] = {encoding.name: encoding
                                  for encoding in (WanScenes(), Scenes(), Preencoded(), Raw(), Ltx2Audio(), Ltx2(), Wan(),
                                                  RawVideo(), Ingested(), SdVaeLatents(), Prompts())}


def encoding_for(settings, kind: str, token: str | None = None) -> str:
    """The encoding a run of ``kind`` (``preencoded``, ``raw``) writes: a pre-encoded run writes its model
    family's (``--family``, or the model's ``model_index.json``), or the variant its settings ask for (LTX-2's
    audio only); a raw run with ``--prompts-only`` stores captions (``prompts``), with ``--resolution-buckets``
    clips (``raw_video``), without them images."""
    if settings.source.type == "scenes":  # posed scenes: stored raw, or through a family that encodes them
        return _scene_encoding(settings, kind, token)
    if kind == contract.ENCODING_RAW and settings.raw.prompts_only:
        return contract.ENCODING_PROMPTS
    if kind == contract.ENCODING_RAW and settings.video.resolution_buckets:
        return contract.ENCODING_RAW_VIDEO
    if kind != contract.ENCODING_PREENCODED:
        return kind
    from diffprep.families import family_of_model

    model = settings.model
    family = family_of_model(model.model_path, model.family, revision=model.revision, token=token)
    return get_encoding(family.encoding).variant(settings)


def _scene_encoding(settings, kind: str, token: str | None) -> str:
    if kind != contract.ENCODING_PREENCODED:
        return contract.ENCODING_SCENES
    from diffprep.families import family_of_model

    model = settings.model
    family = family_of_model(model.model_path, model.family, revision=model.revision, token=token)
    if family.encoding != contract.ENCODING_WAN:
        raise ConfigError(f"posed scenes are pre-encoded with a Wan model only; {model.model_path!r} is "
                          f"{family.encoding}: use a Wan model, or store them raw with `diffprep raw`")
    return contract.ENCODING_WAN_SCENES


def unit_files_layout(plan) -> Any:
    """The layout module of a plan whose units write files instead of shards (the LTX trainer's, GAE's): what
    audits, checks, owns and reads those files (``audit_unit``, ``audit_folders``, ``check_shapes``,
    ``planned_files``, ``read_by_trainer``, ``stored_samples``); None for shards."""
    if plan is None or plan.encoding not in ENCODINGS:
        return None
    own = ENCODINGS[plan.encoding].own_folders(plan)
    return own if getattr(own, "UNIT_FILES", False) else None


def encoding_of_sample(fields) -> Encoding:
    """The encoding whose samples have these fields (a dataset read without its plan)."""
    for encoding in ENCODINGS.values():
        if encoding.holds(fields):
            return encoding
    raise ConfigError(f"no encoding stores samples with the fields {sorted(fields)}")


def get_encoding(name: str) -> Encoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ConfigError(f"encoding must be one of {list(ENCODINGS)}, got {name!r}") from None


__all__ = ["ENCODINGS", "Encoding", "Ingested", "Ltx2", "Ltx2Audio", "Preencoded", "Prompts", "Raw", "RawVideo",
           "SampleFields", "Scenes", "SdVaeLatents", "Wan", "WanScenes", "encoding_for", "encoding_of_sample",
           "get_encoding", "unit_files_layout"]
