"""The class-folder image source: labels from the sorted folders, captions through the shared label rules."""

from __future__ import annotations

import json
import tarfile

import pytest
from class_folders import jpeg_bytes, png_bytes, write_class_folders

from diffprep import contract
from diffprep.config import load_settings
from diffprep.errors import SourceError
from diffprep.sources import open_source
from diffprep.sources.imagefolder import ImageFolderSource
from diffprep.sources.labels import LabeledSample, imagenet_classes, imagenet_names_for


def test_labels_are_sorted_folder_indices_and_every_file_is_a_sample_or_a_reject(tmp_path) -> None:
    root = write_class_folders(tmp_path / "train", {"dogs": 2, "cats": 1})
    (root / "cats" / "deeper" / "more").mkdir(parents=True)
    (root / "cats" / "deeper" / "more" / "Z.jpeg").write_bytes(jpeg_bytes(9))
    (root / "cats" / "x.Png").write_bytes(png_bytes(3))
    (root / "dogs" / "notes.md").write_text("not an image")
    (root / "README.txt").write_text("top level")
    source = ImageFolderSource(str(root), caption_template="a photo of a {label}")
    ids = list(source.list_ids())
    assert ids == ["README.txt", "cats/cats_0.JPEG", "cats/deeper/more/Z.jpeg", "cats/x.Png",
                   "dogs/dogs_0.JPEG", "dogs/dogs_1.JPEG", "dogs/notes.md"]
    samples = {s.source_id: s for s in source.read(ids)}
    assert samples["README.txt"].reject.reason == "outside_class_folder"
    assert samples["dogs/notes.md"].reject.reason == "unsupported_format"
    good = [s for s in samples.values() if s.reject is None]
    assert len(good) == 5 and all(isinstance(s, LabeledSample) for s in good)
    assert samples["cats/deeper/more/Z.jpeg"].label == 0 and samples["dogs/dogs_1.JPEG"].label == 1
    assert samples["dogs/dogs_1.JPEG"].caption == "a photo of a dogs"  # no names given: the folders'
    assert samples["cats/x.Png"].image == png_bytes(3)
    assert source.describe()["names_from"] == "folders"


def test_class_names_file_must_name_every_folder_and_the_template_is_checked(tmp_path) -> None:
    root = write_class_folders(tmp_path / "train", {"a": 1, "b": 1})
    names = tmp_path / "names.txt"
    names.write_text("apple\nbanana\n")
    source = ImageFolderSource(str(root), class_names=str(names))
    assert [s.caption for s in source.read(list(source.list_ids()))] == ["apple", "banana"]
    names.write_text("apple\n")
    with pytest.raises(SourceError, match="1 names .* 2 class folders"):
        ImageFolderSource(str(root), class_names=str(names))
    with pytest.raises(SourceError, match="must hold {label}"):
        ImageFolderSource(str(root), caption_template="a photo of {name}")


def test_the_1000_imagenet_synsets_get_the_shipped_names(tmp_path) -> None:
    classes = imagenet_classes()
    assert len(classes) == 1000 and [w for w, _ in classes] == sorted(w for w, _ in classes)
    assert classes[0] == ("n01440764", "tench") and classes[999][1] == "toilet tissue"
    # WordNet's two repeated names as GAE words them: every class has its own caption.
    assert len({name for _, name in classes}) == 1000
    assert [classes[i] for i in (134, 517, 638, 639)] == [("n02012849", "crane bird"), ("n03126707", "crane"),
                                                          ("n03710637", "maillot"), ("n03710721", "maillot tank suit")]
    wnids = [w for w, _ in classes]
    assert imagenet_names_for(wnids)[1] == "goldfish"
    # A subset of the synsets (ImageNet-100, a test slice) is named by each folder's id, not by its position.
    assert imagenet_names_for(wnids[1:3]) == ["goldfish", "great white shark"]
    assert imagenet_names_for([*wnids[1:3], "cats"]) is None and imagenet_names_for([]) is None
    root = tmp_path / "train"
    for wnid in wnids:
        (root / wnid).mkdir(parents=True)
    (root / "n01443537" / "n01443537_1.JPEG").write_bytes(jpeg_bytes(1))
    source = ImageFolderSource(str(root))
    assert source.describe()["names_from"] == "imagenet-1k"
    (sample,) = source.read(list(source.list_ids()))
    assert (sample.label, sample.class_name, sample.caption) == (1, "goldfish", "goldfish")


def test_the_source_type_is_explicit_and_open_source_builds_it(tmp_path) -> None:
    root = write_class_folders(tmp_path / "train", {"a": 1})
    cfg = load_settings(overrides={"source": {"type": "imagefolder", "input_dir": str(root)}}).source
    assert isinstance(open_source(cfg), ImageFolderSource)
    # --input-dir alone still means the directory source.
    assert load_settings(overrides={"source": {"input_dir": str(root)}}).source.type == "directory"


@pytest.mark.slow
def test_labels_and_captions_reach_the_flux_shards(tmp_path, tiny_model, settings_for) -> None:
    from diffprep.phases.pipeline import run

    root = write_class_folders(tmp_path / "train", {"n1": 2, "n0": 3})
    out = tmp_path / "out"
    settings = settings_for(out, root, tiny_model, source={"type": "imagefolder",
                            "caption_template": "a photo of a {label}"}, finalize={"train_split": 1.0})
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).samples == 5
    metas, captions = {}, {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                data = tar.extractfile(member).read()
                if ext == contract.META:
                    metas[key] = json.loads(data)
                elif ext == contract.CAPTION:
                    captions[key] = data.decode()
    by_source = {meta["source_id"]: (meta["label"], meta["class_name"], captions[key]) for key, meta in metas.items()}
    assert by_source == {"n0/n0_0.JPEG": (0, "n0", "a photo of a n0"), "n0/n0_1.JPEG": (0, "n0", "a photo of a n0"),
                         "n0/n0_2.JPEG": (0, "n0", "a photo of a n0"), "n1/n1_0.JPEG": (1, "n1", "a photo of a n1"),
                         "n1/n1_1.JPEG": (1, "n1", "a photo of a n1")}
