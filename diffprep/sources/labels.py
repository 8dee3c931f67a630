"""Class labels as captions: what the huggingface source's ``ClassLabel`` columns and the imagefolder source share.

A label is an integer (for a folder tree: the index of the class folder in
sorted order); its caption is ``source.caption_template`` (``{label}``: the
class name alone, the default; ``a photo of a {label}``) filled with the class
name. The names come from ``--class-names FILE`` (one per line, label 0 first;
read by ``base.read_class_names``), a dataset's own ``ClassLabel`` names, or,
for the 1000 ImageNet synset folders, the ImageNet-1k names shipped with
diffprep (``data/imagenet1k_classes.tsv``: its header names where they come from).
A label with no name is an ``invalid_caption`` reject.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from diffprep.errors import SourceError
from diffprep.sources.base import SourceSample, reject

DEFAULT_TEMPLATE = "{label}"
IMAGENET_CLASSES_FILE = "imagenet1k_classes.tsv"  # in diffprep/data/


def checked_template(template: str | None) -> str:
    """The caption template to use (unset: ``{label}``); a ``SourceError`` when it cannot be filled with a name."""
    chosen = template or DEFAULT_TEMPLATE
    try:
        usable = "{label}" in chosen and chosen.format(label="x")
    except (KeyError, IndexError, ValueError):
        usable = False
    if not usable:
        raise SourceError(f"source.caption_template {template!r} must hold {{label}} (the class name) "
                          "and no other {...} field, e.g. 'a photo of a {label}'")
    return chosen


def check_num_classes(num_classes: int | None, described: Mapping) -> None:
    """Refuse ``--num-classes`` where the opened source (its ``describe()``) makes the asked label width impossible:
    a source without labels, or one that knows another class count (its labels run 0..classes-1, so FastGen's
    width ``max(label)+1`` could never be the one asked)."""
    if num_classes is None:
        return
    classes, kind = described.get("classes"), described.get("type")
    flag = f"source.num_classes (--num-classes {num_classes})"
    if classes is None:
        raise SourceError(f"{flag} is the label width of a labeled source (class folders, CIFAR-10, a Hugging Face "
                          f"ClassLabel column or --class-names); this {kind} source has no labels, so its "
                          "dataset.json would be {\"labels\": null}: remove --num-classes")
    if classes != num_classes:
        if kind == "imagefolder":
            fix = ("give one folder per class (an empty folder keeps its index in the sorted order), or remove "
                   "--num-classes")
        else:
            fix = "remove --num-classes (validation checks the source's own count without it)"
        raise SourceError(f"{flag} contradicts the {kind} source's {classes} classes: its labels run "
                          f"0..{classes - 1}, so the loader's label width max(label)+1 can never be {num_classes}: "
                          f"{fix}")


@cache
def imagenet_classes() -> tuple[tuple[str, str], ...]:
    """The ImageNet-1k classes shipped with diffprep: ``(wnid, name)`` for labels 0..999, synsets sorted."""
    text = resources.files("diffprep").joinpath("data", IMAGENET_CLASSES_FILE).read_text(encoding="utf-8")
    rows = [line.split("\t") for line in text.splitlines() if line and not line.startswith("#")]
    return tuple((wnid, name) for wnid, name in rows)


def imagenet_names_for(folders: Sequence[str]) -> list[str] | None:
    """The ImageNet-1k names of ``folders`` when every one is an ImageNet-1k synset id (all 1000, or a subset such
    as ImageNet-100: each folder's own name, looked up by its id, never by its position), else None."""
    names = dict(imagenet_classes())
    if not folders or any(folder not in names for folder in folders):
        return None
    return [names[folder] for folder in folders]


@dataclass(frozen=True)
class LabelCaptions:
    """Captions of integer class labels: ``names[label]`` through ``template``."""

    names: Sequence[str] | None  # None: no names known (a label is then a reject naming --class-names)
    template: str = DEFAULT_TEMPLATE
    what: str = "the label"  # how a reject names where the label came from

    def name(self, label: int, where: str) -> str:
        """The class name of ``label``; a ``RejectError`` (invalid_caption) when it has none."""
        if self.names is None:
            raise reject("invalid_caption", f"{where}: {self.what} holds the class label {label} and no "
                         "class names are known: pass --class-names FILE (one name per line, label 0 first)")
        if not 0 <= label < len(self.names):
            raise reject("invalid_caption", f"{where}: class label {label} is not one of the {len(self.names)} "
                         f"class names (0..{len(self.names) - 1})")
        return self.names[label]

    def caption(self, label: int, where: str) -> str:
        return self.template.format(label=self.name(label, where)).strip()


@dataclass(frozen=True)
class LabeledSample(SourceSample):
    """A sample of a class-conditional source: its label (class folder index) and class name, kept in meta.json."""

    label: int | None = None
    class_name: str | None = None
