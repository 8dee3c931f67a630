"""CIFAR-10's python release (``cifar-10-python.tar.gz``) read as it ships, without unpickling anything else.

The tarball holds ``cifar-10-batches-py/data_batch_1`` .. ``_5`` (the train split,
50,000 images) and ``test_batch`` (the test split, 10,000): each a pickled dict
of ``data`` (uint8 [10000, 3072], each row the red, green and blue 32x32 planes)
and ``labels`` (10,000 ints in 0..9). Samples keep the files' order, batch by
batch: ids ``data_batch_1/00000`` ...; the label is the file's, the class name
CIFAR-10's (``--class-names`` to rename them), the caption ``--caption-template``
filled with it. Each image is handed over as a lossless PNG of its 32x32 pixels.

A pickle runs whatever its file names, so ``pickle.load`` is never called on it:
``RestrictedUnpickler`` resolves only what an array of the release needs (numpy's
array reconstructor, ``ndarray``, ``dtype`` and the codec a bytes object of an
older protocol is rebuilt with); any other global is refused, naming it.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from PIL import Image

from diffprep.config.sections import CIFAR10_SIDE
from diffprep.errors import SourceError
from diffprep.sources.base import SourceSample, file_stamp, read_class_names
from diffprep.sources.labels import LabelCaptions, LabeledSample, checked_template

TARBALL = "cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
SPLITS = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SIDE = CIFAR10_SIDE
NUM_CLASSES = len(CLASS_NAMES)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import codecs

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): codecs.encode}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # written by numpy 1.x or 2.x
        allowed[(module, "_reconstruct")] = _reconstruct
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only numpy arrays, dtypes, dicts, lists, strings, bytes and numbers."""

    _allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not something a CIFAR-10 batch holds; refused")
        return found


def load_batch(data: bytes, where: str) -> tuple[np.ndarray, list[int]]:
    """One batch file's bytes -> (uint8 images [N, 32, 32, 3], labels), checked against the release's format."""
    try:
        batch = RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as error:  # noqa: BLE001 - a refused global, a truncated file: one message with the fix
        raise SourceError(f"{where} is not a CIFAR-10 python batch ({type(error).__name__}: {error}); give the "
                          f"unmodified {TARBALL}") from None
    if not isinstance(batch, dict):
        raise SourceError(f"{where} holds a {type(batch).__name__}, a CIFAR-10 batch is a dict")
    batch = {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in batch.items()}
    images, labels = batch.get("data"), batch.get("labels")
    if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 2
            and images.shape[1] == 3 * SIDE * SIDE):
        raise SourceError(f"{where}: 'data' must be uint8 [N, {3 * SIDE * SIDE}], got "
                          f"{getattr(images, 'dtype', type(images).__name__)} {list(getattr(images, 'shape', []))}")
    if not (isinstance(labels, list) and len(labels) == len(images)
            and all(type(v) is int and 0 <= v < NUM_CLASSES for v in labels)):
        raise SourceError(f"{where}: 'labels' must be {len(images)} ints in 0..{NUM_CLASSES - 1}")
    return images.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1), labels


def png_of(pixels: np.ndarray) -> bytes:
    """uint8 [32, 32, 3] -> PNG bytes (lossless: the reader decodes exactly these pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(buffer, format="PNG", compress_level=0, optimize=False)
    return buffer.getvalue()


class Cifar10Source:
    """CIFAR-10's train or test split from its python tarball (the module docstring)."""

    def __init__(self, tarball: str, *, split: str = "train", class_names: str | None = None,
                 caption_template: str | None = None) -> None:
        if split not in SPLITS:
            raise SourceError(f"source.cifar_split must be one of {list(SPLITS)}, got {split!r}")
        self.tarball, self.split, self.class_names_file = tarball, split, class_names
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                members = set(tar.getnames())
        except (OSError, tarfile.TarError) as error:
            raise SourceError(f"source.input_path {tarball} is not a readable {TARBALL} ({error}); download "
                              "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz") from None
        missing = [f"{FOLDER}/{name}" for name in SPLITS[split] if f"{FOLDER}/{name}" not in members]
        if missing:
            raise SourceError(f"{tarball} has no {missing}: give the CIFAR-10 python release ({TARBALL})")
        names = read_class_names(class_names) if class_names else list(CLASS_NAMES)
        if len(names) != NUM_CLASSES:
            raise SourceError(f"source.class_names {class_names} has {len(names)} names, CIFAR-10 has "
                              f"{NUM_CLASSES} classes")
        self._captions = LabelCaptions(names, checked_template(caption_template), what="its batch file")
        self._batches: dict[str, tuple[np.ndarray, list[int]]] = {}

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES

    def describe(self) -> dict:
        return {"type": "cifar10", "input_path": self.tarball, "split": self.split, "classes": NUM_CLASSES,
                "class_names": self.class_names_file, "caption_template": self._captions.template}

    def _batch(self, name: str) -> tuple[np.ndarray, list[int]]:
        if name not in self._batches:
            self._batches.clear()  # one batch (30 MB) at a time: units read ids in order
            with tarfile.open(self.tarball, "r:gz") as tar:
                handle = tar.extractfile(f"{FOLDER}/{name}")
                if handle is None:
                    raise SourceError(f"{self.tarball}: {FOLDER}/{name} is not a file")
                self._batches[name] = load_batch(handle.read(), f"{self.tarball}:{FOLDER}/{name}")
        return self._batches[name]

    def list_ids(self) -> Iterator[str]:
        for name in SPLITS[self.split]:
            images, _ = self._batch(name)
            for index in range(len(images)):
                yield f"{name}/{index:05d}"

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            name, _, index = source_id.partition("/")
            if name not in SPLITS[self.split] or not index.isdigit():
                raise SourceError(f"{source_id!r} is not an id of CIFAR-10's {self.split} split")
            images, labels = self._batch(name)
            label = labels[int(index)]
            where = f"{self.tarball}:{source_id}"
            yield LabeledSample(source_id, png_of(images[int(index)]), self._captions.caption(label, where),
                                label=label, class_name=self._captions.name(label, where))

    def stamps(self, ids: Sequence[str]) -> dict[str, str]:
        stamp = file_stamp(self.tarball)
        return {source_id: stamp for source_id in ids}


__all__ = ["CLASS_NAMES", "Cifar10Source", "RestrictedUnpickler", "load_batch"]
