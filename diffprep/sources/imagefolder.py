"""A class-folder image tree, the ImageNet train layout: ``<input_dir>/<class>/<any depth>/<image>``.

Every folder directly under ``input_dir`` is a class; its label is its index
among them in sorted (bytewise) order, as pretrained class-conditional models
number ImageNet's synsets 0..999. Every file below a class folder, at any
depth, is a sample (an image extension of ``base.IMAGE_EXTENSIONS`` in any
letter case: ``.JPEG``, ``.jpg``, ``.png``, ``.webp``) or a named reject: any
other file is ``unsupported_format``, a file directly in ``input_dir`` is
``outside_class_folder``. Symlinked folders are not followed (they could loop);
symlinked files are read.

The id of a sample is ``<class>/<path below it>`` with forward slashes
(``n01440764/n01440764_10026.JPEG``), percent-escaped as every source escapes
names (``base.escape_id``); ids are listed class by class, each class's files
in bytewise order, walking one folder at a time.

Class names (``labels.py``): ``--class-names FILE`` (as many lines as class
folders), else the shipped ImageNet-1k names when every folder is one of its
synset ids (all 1000 or a subset, each looked up by its id), else the folder names themselves. The caption is
``--caption-template`` filled with the name (``{label}``, the name alone, by
default). Each sample carries its label and class name (``LabeledSample``) into
meta.json.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from diffprep.errors import SourceError
from diffprep.sources.base import (
    SourceSample,
    escape_id,
    is_image_name,
    read_class_names,
    reject,
    unescape_id,
    unsupported,
)
from diffprep.sources.labels import LabelCaptions, LabeledSample, checked_template, imagenet_names_for

OUTSIDE_CLASS_FOLDER = "outside_class_folder"
NAMES_FROM_FILE, NAMES_FROM_IMAGENET, NAMES_FROM_FOLDERS = "class_names_file", "imagenet-1k", "folders"


def _walk(top: str, prefix: str) -> Iterator[str]:
    """Relative paths (``/``-separated, unescaped) of every file below ``top``, in bytewise order of the path."""
    entries = []
    with os.scandir(top) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                entries.append((entry.name + "/", entry.path, True))
            elif entry.is_file() or entry.is_symlink():  # a dangling link is listed and read as a reject
                entries.append((entry.name, entry.path, False))
    for name, path, is_dir in sorted(entries, key=lambda e: e[0].encode("utf-8", "surrogateescape")):
        if is_dir:
            yield from _walk(path, prefix + name)
        else:
            yield prefix + name


class ImageFolderSource:
    """Images in class folders (see the module docstring)."""

    def __init__(self, input_dir: str, *, class_names: str | None = None, caption_template: str | None = None
                 ) -> None:
        self.input_dir = os.path.abspath(os.path.expanduser(input_dir))
        if not os.path.isdir(self.input_dir):
            raise SourceError(f"source.input_dir {input_dir} is not a folder: give the folder of class folders "
                              "(ImageNet's train/: <class>/<image>)")
        with os.scandir(self.input_dir) as it:
            self.classes = sorted((e.name for e in it if e.is_dir(follow_symlinks=False)),
                                  key=lambda name: name.encode("utf-8", "surrogateescape"))
        if not self.classes:
            raise SourceError(f"source.input_dir {input_dir} holds no class folder: an imagefolder source needs "
                              "<input_dir>/<class>/<image> (ImageNet's train/ layout)")
        self._label = {escape_id(name): index for index, name in enumerate(self.classes)}
        self.class_names_file = class_names
        names, self.names_from = self._names(class_names)
        self._captions = LabelCaptions(names, checked_template(caption_template), what="its class folder")

    def _names(self, path: str | None) -> tuple[list[str], str]:
        if path:
            names = read_class_names(path)
            if len(names) != len(self.classes):
                raise SourceError(f"source.class_names {path} has {len(names)} names and {self.input_dir} "
                                  f"{len(self.classes)} class folders: give one name per class folder, in the "
                                  "folders' sorted order")
            return names, NAMES_FROM_FILE
        imagenet = imagenet_names_for(self.classes)
        if imagenet is not None:
            return imagenet, NAMES_FROM_IMAGENET
        return list(self.classes), NAMES_FROM_FOLDERS

    @property
    def class_names(self) -> list[str]:
        return list(self._captions.names or ())

    def describe(self) -> dict:
        return {
            "type": "imagefolder",
            "input_dir": self.input_dir,
            "classes": len(self.classes),
            "class_names": self.class_names_file,
            "names_from": self.names_from,
            "caption_template": self._captions.template,
        }

    def list_ids(self) -> Iterator[str]:
        with os.scandir(self.input_dir) as it:
            top_files = sorted(e.name for e in it if not e.is_dir(follow_symlinks=False))
        for name in top_files:
            yield escape_id(name)
        for name in self.classes:
            for rel in _walk(os.path.join(self.input_dir, name), name + "/"):
                yield escape_id(rel)

    def label_of(self, source_id: str) -> int | None:
        """The label of an id (its class folder's index), None for a file outside every class folder."""
        folder, slash, _ = source_id.partition("/")
        return self._label.get(folder) if slash else None

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            yield self._sample(source_id)

    def _sample(self, source_id: str) -> SourceSample:
        path = os.path.join(self.input_dir, *unescape_id(source_id).split("/"))
        where = f"{self.input_dir}/{source_id}"
        label = self.label_of(source_id)
        if label is None:
            return SourceSample(source_id, None, None, reject(
                OUTSIDE_CLASS_FOLDER, f"{where} is not in a class folder: an imagefolder source reads "
                "<input_dir>/<class>/<image>"))
        class_name = self._captions.name(label, where)
        caption = self._captions.caption(label, where)
        if not is_image_name(source_id):
            return LabeledSample(source_id, None, caption, unsupported(where, source_id),
                                 label=label, class_name=class_name)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return LabeledSample(source_id, None, caption, reject("source_missing", f"{where} is gone"),
                                 label=label, class_name=class_name)
        except OSError as error:
            return LabeledSample(source_id, None, caption, reject("source_read_error", f"{where}: {error}"),
                                 label=label, class_name=class_name)
        return LabeledSample(source_id, data, caption, label=label, class_name=class_name)
