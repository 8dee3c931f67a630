"""Settings: defaults < YAML file < environment (``DIFFPREP_SECTION__FIELD``) < explicit parameters.

The sections themselves, every setting with its description, are ``diffprep.config.sections``.

The YAML file has the sections ``source``, ``output``, ``model``, ``image``,
``video``, ``scenes``, ``raw``, ``finalize``, ``auth`` and ``workers``; an unknown section or key is an error that names it.
Its ``${VAR}`` / ``${VAR:default}`` are expanded and Primus's spellings taken first (``config_files``); a path
setting that still holds ``${`` is refused, so no folder is ever created under such a name.
Parameters passed explicitly (CLI flags, flow parameters) win even when they
equal the default: the CLI only passes the flags the user typed.
"""

from __future__ import annotations

import contextvars
import os
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from diffprep.config.files import read_config
# The sections and their types, also used from here (``from diffprep.config import SourceConfig``).
from diffprep.config.sections import (CIFAR10_SIDE, DEFAULT_MODEL, SECTIONS, SOURCE_LOCATIONS, SOURCE_NEEDS,  # noqa: F401
                                      AuthConfig, Crop, FamilyName, FinalizeConfig, FrameSampling, ImageConfig,
                                      LatentMode, Layout, ModelConfig, OnExisting, OnSplitChange, OutputConfig,
                                      Precision, RawConfig, RawImageFormat, SceneConfig, SceneFormat, SourceConfig,
                                      SourceType, VideoConfig, WorkersConfig)
from diffprep.errors import ConfigError

# The YAML data for the Settings() call in progress; a ContextVar keeps concurrent loads apart.
_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_YAML_DATA", default={})


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field, field_name):  # pragma: no cover - not used, __call__ returns everything
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data


class Settings(BaseSettings):
    """All settings of one run. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(env_prefix="DIFFPREP_", env_nested_delimiter="__", extra="forbid")

    source: SourceConfig = SourceConfig()
    output: OutputConfig = OutputConfig()
    model: ModelConfig = ModelConfig()
    image: ImageConfig = ImageConfig()
    video: VideoConfig = VideoConfig()
    scenes: SceneConfig = SceneConfig()
    raw: RawConfig = RawConfig()
    finalize: FinalizeConfig = FinalizeConfig()
    auth: AuthConfig = AuthConfig()
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _layout_defaults(self) -> Settings:
        """A value the user did not give follows what the layout or source allows (``implied_defaults``)."""
        for section, key, value in implied_defaults(self):
            setattr(getattr(self, section), key, value)
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings, env_settings, _YamlSource(settings_cls, _YAML_DATA.get()))


def implied_defaults(settings: Settings) -> list[tuple[str, str, Any]]:
    """(section, key, value) for each setting the user left unset (no flag, parameter, env or YAML key) whose
    default the run's layout or source contradicts: EDM's archive (``--layout edm-zip``) holds PNGs only, and
    CIFAR-10 is stored at its own 32 px. Given, such a value is the user's: a contradiction is an error naming it
    (``edm_zip.check_settings``), never a silent change."""
    implied = []
    if settings.output.layout == "edm-zip" and "image_format" not in settings.raw.model_fields_set:
        implied.append(("raw", "image_format", "png"))
    if settings.source.type == "cifar10" and "image_size" not in settings.image.model_fields_set:
        implied.append(("image", "image_size", CIFAR10_SIDE))
    return implied


def stretch_note(settings: Settings) -> str | None:
    """What a run does to a non-square image that the settings alone do not make plain: with ``center_crop``
    off (every shipped Primus config has ``center_crop: false``) a fixed-size image is stretched to the square,
    its aspect ratio lost. Said in the plan's log and the run's summary; None when images are cropped, keep
    their ratio (variable size, buckets) or none are prepared (clips, scenes, captions only, audio)."""
    image, video = settings.image, settings.video
    if image.center_crop or image.variable_size or image.buckets:
        return None
    clips_or_no_pixels = video.resolution_buckets or video.audio_durations or settings.raw.prompts_only
    if settings.source.type == "scenes" or clips_or_no_pixels:
        return None
    size = image.image_size
    return (f"images are stretched to {size}x{size}, not cropped (image.center_crop is off): a non-square image "
            "loses its aspect ratio; --center-crop (center_crop: true) crops its centre instead")


class _RunParameters(BaseModel):
    """Flow parameters (a form in the Prefect UI): only the fields given count.

    They override the environment and the config file, the way typed CLI flags do.
    """

    model_config = ConfigDict(extra="forbid")

    config: str | None = Field(None, description="YAML config file, on the machine that runs the flow.")
    source: SourceConfig = Field(default_factory=SourceConfig, description="Where samples come from.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="Destination, sharding, approvals.")
    image: ImageConfig = Field(default_factory=ImageConfig, description="Image decoding and sizing.")
    scenes: SceneConfig = Field(default_factory=SceneConfig, description="Posed scenes: frames, chunks, size.")
    finalize: FinalizeConfig = Field(default_factory=FinalizeConfig, description="Energon metadata and splits.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Hugging Face credentials.")

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The settings given explicitly, per section."""
        given = self.model_dump(mode="json", include=set(SECTIONS), exclude_unset=True)
        return {section: values for section, values in given.items() if values}


class EncodeParameters(_RunParameters):
    """The parameters of the encode-dataset flow."""

    encoder_spec: str | None = Field(
        None, description="Name of a saved diffprep encoder-spec block; its settings apply under the model fields "
        "given here."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Encoders, precision, batch size.")
    video: VideoConfig = Field(default_factory=VideoConfig, description="Video families: buckets, frame rate.")
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="Encode processes, devices, fan-out.")


class RawParameters(_RunParameters):
    """The parameters of the encode-raw flow: images and captions stored without encoders."""

    raw: RawConfig = Field(default_factory=RawConfig, description="File format and quality of the stored images "
                           "and clips.")
    video: VideoConfig = Field(default_factory=VideoConfig, description="Clips: buckets (set them to store clips), "
                               "frame rate, frame sampling.")


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a config file (variables expanded, Primus's spellings taken) and refuse unknown sections and keys,
    naming them (``config_files.read_config``)."""
    return read_config(path, SECTIONS)


def load_settings(config: str | os.PathLike | None = None,
                  overrides: dict[str, dict[str, Any]] | None = None) -> Settings:
    """Build the settings: ``overrides`` (explicit, per section) > env > YAML file > defaults."""
    yaml_data = read_yaml(config) if config else {}
    overrides = overrides or {}
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
        for key in values:
            if key not in SECTIONS[section].model_fields:
                raise ConfigError(f"unknown setting {section}.{key}; "
                                  f"valid: {', '.join(SECTIONS[section].model_fields)}")
    token = _YAML_DATA.set(yaml_data)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    finally:
        _YAML_DATA.reset(token)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "invalid settings:\n  " + "\n  ".join(lines)


def check_runnable(settings: Settings) -> None:
    """Checks that span sections, made before any work starts."""
    src = settings.source
    if src.type is None:
        given = [f"source.{field}" for field in SOURCE_LOCATIONS.values() if getattr(src, field)]
        which = f"several source locations are set ({', '.join(given)})" if given else "no source location is set"
        raise ConfigError(f"source.type is not set and {which}: pass --source-type "
                          f"{'|'.join(SOURCE_NEEDS)} with its location, or set them in the config")
    needed = SOURCE_NEEDS[src.type]
    if not getattr(src, needed):
        flag = "--" + needed.replace("_", "-")
        raise ConfigError(f"source.type is {src.type!r} but source.{needed} is not set (pass {flag})")
    if src.type == "scenes" and src.scene_format is None:
        raise ConfigError("source.type is 'scenes' but source.scene_format is not set (pass --scene-format "
                          f"{'|'.join(get_args(SceneFormat))})")
    if settings.video.frame_sampling == "progressive" and src.type != "scenes":
        raise ConfigError("--frame-sampling progressive follows the camera poses of posed scenes (--source-type "
                          "scenes); clips take head or uniform")
    if not settings.output.output_dir:
        raise ConfigError("output.output_dir is not set (pass --output-dir)")
    if settings.output.layout == "ltx":
        if src.type != "metadata":
            raise ConfigError(f"--layout ltx names each sample after its media path relative to the metadata file, "
                              f"as the LTX-2 trainer does: use --source-type metadata --metadata-file FILE "
                              f"(got source.type {src.type!r})")
        if settings.output.output_dir.startswith("s3://"):
            raise ConfigError("--layout ltx writes the trainer's folders on a local file system; write it locally "
                              "and copy the .precomputed folder, or use the default Energon layout for s3://")
    if settings.output.layout == "edm-zip" and settings.output.output_dir.startswith("s3://"):
        raise ConfigError("--layout edm-zip writes dataset.zip on a local file system; write it locally and copy "
                          "the zip, or use the default Energon layout for s3://")
    if settings.output.compress:
        raise ConfigError(
            "output.compress is refused: Energon prepare indexes uncompressed .tar shards only, and the tensors "
            "are already dense (gzip saves little). Remove --compress."
        )
