"""A Hugging Face dataset: a hub name, a local folder loadable by ``load_dataset``, or a ``save_to_disk`` folder.

Ids are ``<split>/<row index>``. The image column is read undecoded
(``datasets.Image(decode=False)``), so the source hands over the original file
bytes; when a row stores only a path (or the column holds path strings), that
local file is read.

A dataset of clips has a video column instead: ``source.video_key``, else the
first ``datasets.Video`` feature, else the first column named one of
``VIDEO_COLUMNS``; its rows become clip samples (``SourceSample.video``). It is
read undecoded too (``datasets.Video(decode=False)``: the file's bytes or its
path, never a torchcodec decoder), so no video decoder is needed to list or read
it. When a dataset has both, the video column is the media (an image beside a
clip is taken for a thumbnail); ``source.image_key`` alone picks the image column.

Non-streaming (the default) the split is a memory-mapped Arrow table: listing
is ``range(num_rows)`` and ``read`` selects the requested rows by index,
never the whole table. A ``save_to_disk`` folder is always read this way (it is
already Arrow on disk; ``hf_streaming`` has nothing to avoid there).

Streaming (``hf_streaming: true``) nothing is prepared locally: ``list_ids``
iterates the split once over the caption column only, and ``read`` of ids
``a..b`` iterates ``skip(a).take(b - a + 1)``. Skipping still walks the rows
before ``a`` (row groups may be skipped for parquet), so reading a whole
dataset unit by unit costs up to units/2 passes over the data; prefer the
non-streaming mode when the dataset fits on local disk.

Keys (``source.image_key`` / ``source.video_key`` / ``source.caption_key``) name a column, or a dotted
path into a column holding a dict or a JSON string (``json.prompt``). Unset,
the image column is the first ``datasets.Image`` feature, else the first column
named one of ``IMAGE_COLUMNS``; the caption column is the first named one of
``CAPTION_COLUMNS``, else the first ``datasets.ClassLabel`` feature. A list
of captions gives its first element.

A class label (ImageNet's ``label``: a ``ClassLabel`` feature, or an integer
column with ``source.class_names``, a file of one name per line) becomes a
caption through ``source.caption_template`` (``a photo of a {label}``; unset:
the class name alone). A label with no name is rejected (``invalid_caption``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import datasets

from diffprep.config import SourceConfig
from diffprep.errors import RejectError, SourceError
from diffprep.sources.base import (
    SourceSample,
    is_missing,
    lookup_path,
    normalize_caption,
    read_class_names,
    reject,
    rejected,
)
from diffprep.sources.labels import LabelCaptions, LabeledSample, checked_template

IMAGE_COLUMNS = ("image", "img", "jpg", "jpeg", "png", "webp")
VIDEO_COLUMNS = ("video", "mp4", "webm", "clip")
CAPTION_COLUMNS = ("text", "caption", "prompt", "txt", "captions", "prompts", "texts", "description", "alt_text")


def _is_save_to_disk_folder(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def _resolve_key(key: str, columns: Sequence[str], setting: str) -> tuple[str, tuple[str, ...]]:
    """Split ``key`` into a column and a field path inside it (``json.prompt`` -> ``json``, ``("prompt",)``)."""
    if key in columns:
        return key, ()
    parts = key.split(".")
    for i in range(1, len(parts)):
        head = ".".join(parts[:i])
        if head in columns:
            return head, tuple(parts[i:])
    raise SourceError(f"source.{setting} {key!r} matches no column; the dataset has columns {list(columns)}")


class HuggingFaceSource:
    """Rows of one split of a Hugging Face dataset (see the module docstring)."""

    def __init__(self, cfg: SourceConfig, *, token: str | None = None) -> None:
        if not cfg.hf_dataset:
            raise SourceError("source.hf_dataset is not set: give a hub dataset name or a local dataset folder")
        self.split = cfg.hf_split
        local = os.path.abspath(os.path.expanduser(cfg.hf_dataset))
        self._from_disk = _is_save_to_disk_folder(local)
        self.dataset_name = local if os.path.exists(local) else cfg.hf_dataset
        self._cfg = cfg
        dataset = self._load_from_disk(local) if self._from_disk else self._load(cfg, token)
        self.streaming = isinstance(dataset, datasets.IterableDataset)

        columns, features = self._columns_and_features(dataset)
        self.image_key, self.video_key = self._media_keys(cfg, columns, features)
        self.caption_key = cfg.caption_key or self._detect_caption_key(columns, features)
        self.is_video = self.video_key is not None
        media_key = self.video_key or self.image_key
        assert media_key is not None
        self._media_name = "video" if self.is_video else "image"
        self._media_column, self._media_path = _resolve_key(media_key, columns, f"{self._media_name}_key")
        self._caption_column, self._caption_path = _resolve_key(self.caption_key, columns, "caption_key")
        self.class_names = self._class_names(cfg, features)
        self.caption_template = checked_template(cfg.caption_template)
        self._labels = LabelCaptions(self.class_names, self.caption_template, what=repr(self.caption_key))

        feature = features.get(self._media_column) if features is not None else None
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(self._media_column, datasets.Image(decode=False))
        elif isinstance(feature, datasets.Video):  # decoding would need torchcodec and give a decoder, not bytes
            dataset = dataset.cast_column(self._media_column, datasets.Video(decode=False))
        self._dataset = dataset.select_columns(list(dict.fromkeys([self._media_column, self._caption_column])))

    def _load_from_disk(self, path: str) -> datasets.Dataset:
        if self._cfg.hf_revision or self._cfg.hf_data_files:
            raise SourceError(
                f"source.hf_dataset {path} is a save_to_disk folder: hf_revision and hf_data_files apply only to "
                f"hub datasets and load_dataset folders; unset them"
            )
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if self.split not in loaded:
                raise SourceError(f"source.hf_split {self.split!r} is not in {path}; its splits are {list(loaded)}")
            return loaded[self.split]
        if loaded.split is not None and str(loaded.split) != self.split:
            raise SourceError(
                f"{path} holds the single split {str(loaded.split)!r}, but source.hf_split is {self.split!r}"
            )
        return loaded

    def _load(self, cfg: SourceConfig, token: str | None) -> datasets.Dataset | datasets.IterableDataset:
        try:
            loaded = datasets.load_dataset(
                cfg.hf_dataset,
                data_files=cfg.hf_data_files,
                split=self.split,
                revision=cfg.hf_revision,
                streaming=cfg.hf_streaming,
                token=token,
            )
        except Exception as exc:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError...)
            raise SourceError(
                f"cannot load the Hugging Face dataset source.hf_dataset={cfg.hf_dataset!r} "
                f"(split={self.split!r}, data_files={cfg.hf_data_files!r}, revision={cfg.hf_revision!r}): "
                f"{type(exc).__name__}: {exc}. Check the name or path; a private or gated hub dataset needs a "
                f"token (auth.hf_token_file or HF_TOKEN)."
            ) from exc
        if not isinstance(loaded, (datasets.Dataset, datasets.IterableDataset)):
            raise SourceError(f"load_dataset({cfg.hf_dataset!r}, split={self.split!r}) gave {type(loaded).__name__}")
        return loaded

    @staticmethod
    def _columns_and_features(dataset: Any) -> tuple[list[str], datasets.Features | None]:
        features = dataset.features
        if features is not None:
            return list(features), features
        # Streaming text formats (json, csv) may not know their columns until a row is read.
        first = next(iter(dataset.take(1)), None)
        if first is None:
            raise SourceError("the Hugging Face dataset split is empty: no rows to read columns from")
        return list(first), None

    @staticmethod
    def _media_keys(cfg: SourceConfig, columns: list[str],
                    features: datasets.Features | None) -> tuple[str | None, str | None]:
        """``(image_key, video_key)``: the column the media come from is the video one when it is not None."""
        if cfg.video_key or cfg.image_key:
            return cfg.image_key, cfg.video_key
        for name, feature in (features or {}).items():  # a Video feature first: an Image beside it is a thumbnail
            if isinstance(feature, datasets.Video):
                return None, name
        for name, feature in (features or {}).items():
            if isinstance(feature, datasets.Image):
                return name, None
        for name in VIDEO_COLUMNS:
            if name in columns:
                return None, name
        for name in IMAGE_COLUMNS:
            if name in columns:
                return name, None
        raise SourceError(
            f"no image or video column found (no datasets.Image or datasets.Video feature, none named "
            f"{list(IMAGE_COLUMNS)} or {list(VIDEO_COLUMNS)}); set source.image_key or source.video_key to one of "
            f"the columns {columns}"
        )

    def _class_names(self, cfg: SourceConfig, features: datasets.Features | None) -> list[str] | None:
        """The class names a label column's integers stand for: a file's lines, else the ClassLabel's own."""
        if cfg.class_names:
            return read_class_names(cfg.class_names)
        feature = features.get(self._caption_column) if features is not None and not self._caption_path else None
        return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None

    @staticmethod
    def _detect_caption_key(columns: list[str], features: datasets.Features | None = None) -> str:
        for name in CAPTION_COLUMNS:
            if name in columns:
                return name
        for name, feature in (features or {}).items():
            if isinstance(feature, datasets.ClassLabel):
                return name
        raise SourceError(
            f"no caption column found (none named {list(CAPTION_COLUMNS)}); set source.caption_key to one of "
            f"the columns {columns}, or a dotted path such as json.prompt"
        )

    def describe(self) -> dict:
        return {
            "type": "huggingface",
            "dataset": self.dataset_name,
            "split": self.split,
            "data_files": self._cfg.hf_data_files,
            "revision": self._cfg.hf_revision,
            "streaming": self.streaming,
            "image_key": self.image_key,
            "video_key": self.video_key,
            "caption_key": self.caption_key,
            "caption_template": self._cfg.caption_template,
            "class_names": self._cfg.class_names,
            # A label column's class count (a ClassLabel's names, or --class-names'): the label width edm-zip's
            # validation expects without --num-classes, as the class-folder and CIFAR-10 sources record theirs.
            **({"classes": len(self.class_names)} if self.class_names is not None and not self.is_video else {}),
        }

    def list_ids(self) -> Iterator[str]:
        if not self.streaming:
            for index in range(len(self._dataset)):
                yield f"{self.split}/{index}"
            return
        index = 0
        for _ in self._dataset.select_columns([self._caption_column]):
            yield f"{self.split}/{index}"
            index += 1

    def _index(self, source_id: str) -> int:
        split, _, index = source_id.rpartition("/")
        if split != self.split or not index.isdigit():
            raise ValueError(f"{source_id!r} is not an id of split {self.split!r} of {self.dataset_name}")
        return int(index)

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        indices = [self._index(source_id) for source_id in ids]
        rows = self._rows_streaming(indices) if self.streaming else self._rows_mapped(indices)
        for source_id, index in zip(ids, indices):
            row = rows.get(index)
            if row is None:
                yield rejected(source_id, "source_missing", f"row {index} is past the end of split {self.split!r}")
            else:
                yield self._sample(source_id, row)

    def _rows_mapped(self, indices: list[int]) -> dict[int, dict]:
        present = sorted({i for i in indices if i < len(self._dataset)})
        # A contiguous list is selected as a slice of the memory-mapped table.
        return dict(zip(present, self._dataset.select(present)))

    def _rows_streaming(self, indices: list[int]) -> dict[int, dict]:
        if not indices:
            return {}
        wanted = set(indices)
        first, last = min(indices), max(indices)
        rows: dict[int, dict] = {}
        for offset, row in enumerate(self._dataset.skip(first).take(last - first + 1)):
            if first + offset in wanted:
                rows[first + offset] = row
        return rows

    def _sample(self, source_id: str, row: dict) -> SourceSample:
        where = f"{self.dataset_name} {source_id}"
        try:
            media = self._media_bytes(lookup_path(row[self._media_column], self._media_path), where)
        except RejectError as exc:
            return SourceSample(source_id, None, None, exc)

        def sample_of(caption: str | None, error: RejectError | None = None) -> SourceSample:
            if self.is_video:
                return SourceSample(source_id, None, caption, error, video=media)
            return SourceSample(source_id, media, caption, error)

        try:
            value = lookup_path(row[self._caption_column], self._caption_path)
            if is_missing(value):
                raise reject("missing_caption", f"{where}: no field {self.caption_key!r}")
            if isinstance(value, int) and not isinstance(value, bool):
                caption = self._label_caption(value, where)
                if not self.is_video:  # the label a class-conditional trainer reads (meta.json; edm-zip's labels)
                    return LabeledSample(source_id, media, caption, label=value,
                                         class_name=self._labels.name(value, where))
            else:
                caption = normalize_caption(value, f"{where} {self.caption_key!r}")
        except RejectError as exc:
            return sample_of(None, exc)
        return sample_of(caption)

    def _label_caption(self, label: int, where: str) -> str:
        return self._labels.caption(label, where)

    def _media_bytes(self, value: Any, where: str) -> bytes:
        """The image's or clip's file bytes from a row's value: bytes, a {bytes, path} dict, or a local path."""
        kind, key = self._media_name, self.video_key or self.image_key
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value.get("path")
        if isinstance(value, bytes):
            return value
        if is_missing(value) or value is None:
            raise reject(f"missing_{kind}", f"{where}: no {kind} in {key!r}")
        if isinstance(value, str):
            if os.path.isfile(value):
                try:
                    with open(value, "rb") as f:
                        return f.read()
                except OSError as exc:
                    raise reject("source_read_error", f"{where}: {exc}") from None
            raise reject(f"missing_{kind}", f"{where}: {kind} path {value!r} in {key!r} is not a file")
        raise reject(
            f"unsupported_{kind}_value",
            f"{where}: {key!r} holds a {type(value).__name__}; expected {kind} bytes, a path, "
            f"or a datasets.{kind.capitalize()} feature",
        )
