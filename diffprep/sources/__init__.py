"""Source readers: turn a dataset into a stream of samples, each with a stable source id.

``open_source(cfg)`` picks the reader for ``cfg.type``. Every reader lists ids
lazily and reads a contiguous run of them at a time, so memory stays bounded by
one work unit, never the dataset. The directory and webdataset readers also
read ``s3://`` URLs (``diffprep.sources.storage``), streamed, never copied to disk; so
does the metadata-file reader, for the file and the media it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diffprep.config import SourceConfig
from diffprep.errors import SourceError
from diffprep.sources.base import Source, SourceSample
from diffprep.sources.directory import DirectorySource
from diffprep.sources.imagefolder import ImageFolderSource
from diffprep.sources.metadata import MetadataSource
from diffprep.sources.webdataset import WebDatasetSource

if TYPE_CHECKING:  # the scenes package is imported when a scenes source is opened
    from diffprep.sources.scenes.base import SceneChunking

SOURCE_TYPES = ("directory", "huggingface", "webdataset", "metadata", "imagefolder", "cifar10", "scenes")


def open_source(cfg: SourceConfig, *, token: str | None = None, scenes: SceneChunking | None = None,
                planned: Mapping[str, Any] | None = None) -> Source:
    """Open the source that ``cfg`` describes; a ``SourceError`` says what is missing.

    ``token`` is a Hugging Face token, used by the huggingface source only. ``scenes`` is how scenes are sampled
    and chunked (``SceneSpec.from_settings``), which decides a scenes source's ids; the other sources ignore it.
    ``planned`` is a plan's ``describe()`` of the source: what listing found that opening need not find again
    (a metadata file's columns); the other sources ignore it.
    """
    if cfg.score_columns and cfg.type != "metadata":
        raise SourceError(f"source.score_columns (--score-column {','.join(cfg.score_columns)}) reads the columns of "
                          f"a metadata file (--source-type metadata --metadata-file FILE); the {cfg.type} source "
                          "has none: remove it")
    if cfg.depth_key and cfg.type != "metadata":
        raise SourceError(f"source.depth_key (--depth-column {cfg.depth_key}) names a column of a metadata file "
                          f"(--source-type metadata --metadata-file FILE); the {cfg.type} source has none: remove it")
    if cfg.type == "directory":
        if not cfg.input_dir:
            raise SourceError("source.input_dir is not set: give the folder holding images/ and captions/")
        return DirectorySource(cfg.input_dir, s3_endpoint_url=cfg.s3_endpoint_url, s3_profile=cfg.s3_profile)
    if cfg.type == "imagefolder":
        if not cfg.input_dir:
            raise SourceError("source.input_dir is not set: give the folder of class folders (ImageNet's train/)")
        return ImageFolderSource(cfg.input_dir, class_names=cfg.class_names, caption_template=cfg.caption_template)
    if cfg.type == "cifar10":
        from diffprep.sources.cifar10 import Cifar10Source

        if not cfg.input_path:
            raise SourceError("source.input_path is not set: give the cifar-10-python.tar.gz release file")
        return Cifar10Source(cfg.input_path, split=cfg.cifar_split, class_names=cfg.class_names,
                             caption_template=cfg.caption_template)
    if cfg.type == "huggingface":
        # Imported here: datasets takes a second to import and only this source needs it.
        from diffprep.sources.huggingface import HuggingFaceSource

        return HuggingFaceSource(cfg, token=token)
    if cfg.type == "webdataset":
        if not cfg.input_path:
            raise SourceError(
                "source.input_path is not set: give a glob of tar shards, e.g. /data/shards/*.tar or "
                "s3://bucket/shards/*.tar"
            )
        return WebDatasetSource(cfg.input_path, image_key=cfg.image_key, caption_key=cfg.caption_key,
                                video_key=cfg.video_key, s3_endpoint_url=cfg.s3_endpoint_url,
                                s3_profile=cfg.s3_profile)
    if cfg.type == "metadata":
        if not cfg.metadata_file:
            raise SourceError(
                "source.metadata_file is not set: give a JSON, JSONL or CSV file listing media paths and captions, "
                "e.g. /data/dataset.json or s3://bucket/dataset.json"
            )
        return MetadataSource(cfg.metadata_file, caption_key=cfg.caption_key, video_key=cfg.video_key,
                              reference_key=cfg.reference_key, audio_key=cfg.audio_key,
                              score_columns=cfg.score_columns or (), depth_key=cfg.depth_key,
                              image_key=cfg.image_key, s3_endpoint_url=cfg.s3_endpoint_url, s3_profile=cfg.s3_profile,
                              planned=planned)
    if cfg.type == "scenes":
        from diffprep.sources.scenes import SceneSource

        if not cfg.input_dir:
            raise SourceError("source.input_dir is not set: give the folder of scenes (--input-dir) and its "
                              "--scene-format")
        if scenes is None:
            raise SourceError("a scenes source is opened with its SceneSpec (how scenes are sampled and chunked "
                              "decides its ids): open_source(cfg, scenes=SceneSpec.from_settings(settings))")
        return SceneSource(cfg.input_dir, cfg.scene_format, scenes, pose_key=cfg.pose_key)
    raise SourceError(f"source.type is {cfg.type!r}; set it to one of {list(SOURCE_TYPES)}")


__all__ = [
    "SOURCE_TYPES",
    "DirectorySource",
    "ImageFolderSource",
    "MetadataSource",
    "Source",
    "SourceSample",
    "WebDatasetSource",
    "open_source",
]
