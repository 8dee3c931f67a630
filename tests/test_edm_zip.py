"""--layout edm-zip: EDM's class-conditional archive, its crops, and CIFAR-10's tarball read without pickle.load.

The loader here is written from FastGen's ImageFolderDataset and EDM's dataset_tool reading rules (every name of
the zip, data files by extension and sorted, PIL -> HWC -> CHW, dataset.json's labels as a dict), not from diffprep.
"""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffprep import contract
from diffprep.config import load_settings
from diffprep.media.crops import adm_center_crop, edm_center_crop
from diffprep.errors import ConfigError, SourceError
from diffprep.sources.cifar10 import Cifar10Source, load_batch


def noise_png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def write_classes(root: Path, sizes: dict[str, list[tuple[int, int]]]) -> Path:
    seed = 0
    for name, shapes in sizes.items():
        (root / name).mkdir(parents=True)
        for index, (width, height) in enumerate(shapes):
            (root / name / f"{name}_{index}.png").write_bytes(noise_png(seed, width, height))
            seed += 1
    return root


def fastgen_read(path: Path) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """(data file names, images [N, C, H, W], int64 labels or None), as FastGen's loader makes them."""
    Image.init()
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        files = sorted(n for n in names if Path(n).suffix.lower() in set(Image.EXTENSION) | {".npy"})
        images = []
        for name in files:
            with archive.open(name) as handle:
                image = np.array(Image.open(handle))
            images.append(image.reshape(*image.shape[:2], -1).transpose(2, 0, 1))
        assert all(i.shape == images[0].shape for i in images)
        labels = None
        if "dataset.json" in names:
            listed = json.loads(archive.read("dataset.json"))["labels"]
            if listed is not None:
                by_name = dict(listed)
                labels = np.array([by_name[name] for name in files]).astype(np.int64)
    return files, np.stack(images), labels


def edm_settings(source: dict, out: Path, **image) -> object:
    return load_settings(overrides={
        "source": source,
        "output": {"output_dir": str(out), "shard_size": 2, "layout": "edm-zip"},
        "image": {"image_size": 32, "decode_workers": 1, **image},
        "raw": {"image_format": "png"},
        "finalize": {"train_split": 1.0},
    })


RAW_PNG = {"fields": ["meta.json", "png", "txt"]}


def never(*args, **kwargs):
    pytest.fail("asked")


# --- crops ------------------------------------------------------------------------------------------------------


def test_edm_crop_is_a_centred_square_then_lanczos() -> None:
    rgb = Image.open(io.BytesIO(noise_png(1, 75, 50))).convert("RGB")
    out, box = edm_center_crop(rgb, 32)
    array = np.array(rgb)
    square = array[0:50, 12:62]  # (75 - 50) // 2 = 12: cut before resampling
    want = np.array(Image.fromarray(square, "RGB").resize((32, 32), Image.Resampling.LANCZOS))
    assert box == (12, 0, 62, 50) and np.array_equal(np.array(out), want)


def test_adm_crop_box_halves_then_bicubic_then_centre_crop() -> None:
    rgb = Image.open(io.BytesIO(noise_png(2, 150, 70))).convert("RGB")
    out, _ = adm_center_crop(rgb, 32)
    halved = rgb.resize((75, 35), Image.Resampling.BOX)  # 70 >= 64: once; 35 < 64: stop
    scaled = np.array(halved.resize((round(75 * 32 / 35), 32), Image.Resampling.BICUBIC))  # 69 x 32
    left = (scaled.shape[1] - 32) // 2
    assert np.array_equal(np.array(out), scaled[:, left:left + 32])


# --- CIFAR-10 ---------------------------------------------------------------------------------------------------


def cifar_batch(seed: int, count: int) -> tuple[bytes, np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (count, 3072), dtype=np.uint8)
    labels = [(seed * count + i) % 10 for i in range(count)]  # the train split's ten images cover 0..9
    # The release's dict (bytes keys, as its Python 2 pickle reads under encoding="bytes"), protocol 2.
    batch = {b"batch_label": b"training batch", b"labels": labels, b"data": data,
             b"filenames": [f"img_{i}.png".encode() for i in range(count)]}
    return pickle.dumps(batch, protocol=2), data, labels


def write_cifar(path: Path, count: int = 2) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    images, labels = {}, {}
    with tarfile.open(path, "w:gz") as tar:
        for seed, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
            blob, data, batch_labels = cifar_batch(seed, count)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
            images[name], labels[name] = data, batch_labels
    return images, labels


def test_cifar_batches_are_read_in_file_order_with_their_labels(tmp_path: Path) -> None:
    tarball = tmp_path / "cifar-10-python.tar.gz"
    images, labels = write_cifar(tarball)
    source = Cifar10Source(str(tarball))
    ids = list(source.list_ids())
    assert ids == [f"data_batch_{b}/{i:05d}" for b in range(1, 6) for i in range(2)]
    samples = list(source.read(ids))
    assert [s.label for s in samples] == [v for b in range(1, 6) for v in labels[f"data_batch_{b}"]]
    first = np.array(Image.open(io.BytesIO(samples[0].image)))
    assert np.array_equal(first, images["data_batch_1"][0].reshape(3, 32, 32).transpose(1, 2, 0))
    test = Cifar10Source(str(tarball), split="test")
    assert [s.label for s in test.read(list(test.list_ids()))] == labels["test_batch"]
    assert samples[0].caption == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                                  "truck"][samples[0].label]


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_a_pickle_naming_anything_else_is_refused_not_run() -> None:
    with pytest.raises(SourceError, match="posix.system|os.system|nt.system"):
        load_batch(pickle.dumps({"data": Evil()}, protocol=2), "data_batch_1")
    with pytest.raises(SourceError, match="'labels' must be"):
        load_batch(pickle.dumps({"data": np.zeros((1, 3072), np.uint8), "labels": [10]}, protocol=2), "b")


# --- the archive ------------------------------------------------------------------------------------------------


def test_edm_zip_settings_are_checked(tmp_path: Path) -> None:
    from diffprep.phases.fetch import fetch

    root = write_classes(tmp_path / "train", {"a": [(40, 40)]})
    source = {"type": "imagefolder", "input_dir": str(root)}
    with pytest.raises(ConfigError, match="power-of-two"):
        fetch(edm_settings(source, tmp_path / "o1", image_size=48), encoding="raw")
    bad = edm_settings(source, tmp_path / "o2")
    bad.raw.image_format = "jpg"
    with pytest.raises(ConfigError, match="stores PNG"):
        fetch(bad, encoding="raw")
    scored = edm_settings(source, tmp_path / "o2")
    scored.source.score_columns = ["aesthetic_score"]  # the archive has nowhere to keep them: refused, not dropped
    with pytest.raises(ConfigError, match="remove --score-column aesthetic_score"):
        fetch(scored, encoding="raw")
    plain = fetch(edm_settings(source, tmp_path / "o3"), encoding="raw")[0]
    counted = fetch(load_settings(overrides={**edm_settings(source, tmp_path / "o3").model_dump(),
                                             "source": {**source, "num_classes": 1}}), encoding="raw")[0]
    assert "num_classes" not in plain.settings and counted.settings["num_classes"] == 1
    assert plain.fingerprint != counted.fingerprint


def test_num_classes_contradicting_the_source_and_cifar_at_another_size_are_refused(tmp_path: Path) -> None:
    from diffprep.phases.fetch import fetch
    from diffprep.sources.labels import check_num_classes

    root = write_classes(tmp_path / "train", {"a": [(40, 40)], "b": [(40, 40)], "c": [(40, 40)]})
    folders = {"type": "imagefolder", "input_dir": str(root)}
    # Three folders give labels 0..2: FastGen's width max(label)+1 can never be 5 (nor 2): refused before any work.
    for asked in (5, 2):
        with pytest.raises(SourceError, match=f"--num-classes {asked}\\) contradicts the imagefolder source's 3 "
                                              "classes.*an empty folder keeps its index"):
            fetch(edm_settings({**folders, "num_classes": asked}, tmp_path / f"o{asked}"), encoding="raw")
    assert not (tmp_path / "o5").exists()
    assert fetch(edm_settings({**folders, "num_classes": 3}, tmp_path / "o3"), encoding="raw")[0].settings[
        "num_classes"] == 3
    tarball = tmp_path / "cifar-10-python.tar.gz"
    write_cifar(tarball, count=1)
    cifar = {"type": "cifar10", "input_path": str(tarball)}
    with pytest.raises(SourceError, match="contradicts the cifar10 source's 10 classes.*remove --num-classes"):
        fetch(edm_settings({**cifar, "num_classes": 100}, tmp_path / "c1"), encoding="raw")
    with pytest.raises(ConfigError, match="CIFAR-10 is 32 px.*remove --image-size 64"):
        fetch(edm_settings(cifar, tmp_path / "c2", image_size=64), encoding="raw")
    # An unlabeled source has no width to ask for: refused, not ignored (and validation fails such an archive).
    with pytest.raises(SourceError, match="this directory source has no labels.*remove --num-classes"):
        check_num_classes(10, {"type": "directory"})
    check_num_classes(None, {"type": "directory"})


def command_settings(*flags: str) -> object:
    """The settings a `diffprep raw` command line gives (only the flags typed override)."""
    from diffprep.cli import build_parser
    from diffprep.cli.flags import overrides_from

    return load_settings(overrides=overrides_from(build_parser().parse_args(["raw", *flags])))


def test_a_value_the_layout_or_source_allows_alone_is_the_default_and_typed_it_is_the_users(tmp_path: Path) -> None:
    from diffprep.encodings.edm_zip import check_settings
    from diffprep.phases.fetch import fetch

    tarball = tmp_path / "cifar-10-python.tar.gz"
    write_cifar(tarball, count=1)
    cifar = ["--source-type", "cifar10", "--input-path", str(tarball)]
    # No --image-format, no --image-size: EDM's archive holds PNGs, CIFAR-10 is 32 px; nothing to refuse.
    plan = fetch(command_settings(*cifar, "--layout", "edm-zip", "--output-dir", str(tmp_path / "a")),
                 encoding="raw")[0]
    assert plan.settings["raw"]["image_format"] == "png" and plan.settings["image"]["image_size"] == 32
    # CIFAR-10 in any layout is 32 px unless asked otherwise; another source keeps 1024 and jpg.
    assert command_settings(*cifar, "--output-dir", "o").image.image_size == 32
    assert command_settings(*cifar, "--output-dir", "o", "--image-size", "64").image.image_size == 64
    other = command_settings("--input-dir", "d", "--output-dir", "o")
    assert (other.raw.image_format, other.image.image_size) == ("jpg", 1024)
    assert command_settings("--input-dir", "d", "--output-dir", "o", "--layout", "edm-zip").raw.image_format == "png"
    # A value typed that the layout contradicts is still refused, naming the flag typed.
    with pytest.raises(ConfigError, match="remove --image-format jpg"):
        check_settings(command_settings(*cifar, "--layout", "edm-zip", "--output-dir", "o", "--image-format", "jpg"))
    with pytest.raises(ConfigError, match="remove --image-size 64"):
        check_settings(command_settings(*cifar, "--layout", "edm-zip", "--output-dir", "o", "--image-size", "64"))


@pytest.mark.slow
def test_class_folders_become_edm_archive_fastgen_reads_and_a_resume_rebuilds_it_byte_for_byte(tmp_path) -> None:
    from diffprep.phases.pipeline import run

    root = write_classes(tmp_path / "train", {"n02": [(64, 48), (40, 70)], "n01": [(32, 32), (90, 60), (33, 40)]})
    out = tmp_path / "out"
    settings = edm_settings({"type": "imagefolder", "input_dir": str(root)}, out, crop="edm")
    result = run(settings, "raw", ask=never)
    assert result.samples == 5
    archive = out / contract.EDM_ZIP
    data = archive.read_bytes()

    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == [f"00000/img{i:08d}.png" for i in range(5)] + ["dataset.json"]
        assert {i.compress_type for i in infos} == {zipfile.ZIP_STORED}
        assert json.loads(zf.read("dataset.json")) == {
            "labels": [[f"00000/img{i:08d}.png", label] for i, label in enumerate([0, 0, 0, 1, 1])]}
        # EDM's PNG: the same pixels saved with compress_level=0, optimize=False, nothing else.
        for info in infos[:-1]:
            stored = zf.read(info)
            again = io.BytesIO()
            Image.open(io.BytesIO(stored)).save(again, format="png", compress_level=0, optimize=False)
            assert stored == again.getvalue()
    files, images, labels = fastgen_read(archive)
    assert images.shape == (5, 3, 32, 32) and labels.tolist() == [0, 0, 0, 1, 1]
    # Sorted class folders, files in order: n01_0 (32x32, kept as is) is the first image.
    first = np.array(Image.open(root / "n01" / "n01_0.png").convert("RGB")).transpose(2, 0, 1)
    assert np.array_equal(images[0], first)
    wide = Image.open(root / "n01" / "n01_1.png").convert("RGB")
    assert np.array_equal(images[1], np.array(edm_center_crop(wide, 32)[0]).transpose(2, 0, 1))
    report = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert report["ok"] and report["summary"]["label_dim"] == 2

    # A unit lost (its manifest gone) and the archive too: the resumed run redoes that unit, the same zip.
    (out / contract.unit_manifest_path(1)).unlink()
    archive.unlink()
    settings.output.on_existing = "resume"
    assert run(settings, "raw", ask=never).samples == 5
    assert archive.read_bytes() == data

    from diffprep.output import Output
    from diffprep.validation.ownership import ownership

    assert contract.EDM_ZIP in ownership(Output(out)).ours


@pytest.mark.parametrize("crop", ["edm", "adm"])
def test_imagenet_layout_at_64_px_reads_as_fastgen_does_with_either_crop(tmp_path, crop) -> None:
    """ImageNet-64 as FastGen's recipes read it: synset folders -> labels by sorted folder, each image the crop's
    64 px square (the sources large enough that --crop adm box-halves first)."""
    from diffprep.media.crops import crop_image
    from diffprep.phases.pipeline import run

    sizes = {"n01443537": [(300, 200)], "n01440764": [(150, 260), (129, 129)], "n01484850": [(200, 140)]}
    root = write_classes(tmp_path / "train", sizes)
    out = tmp_path / "out"
    assert run(edm_settings({"type": "imagefolder", "input_dir": str(root)}, out, image_size=64, crop=crop), "raw",
               ask=never).samples == 4
    files, images, labels = fastgen_read(out / contract.EDM_ZIP)
    assert files == [f"00000/img{i:08d}.png" for i in range(4)] and images.shape == (4, 3, 64, 64)
    assert labels.tolist() == [0, 0, 1, 2]  # n01440764 < n01443537 < n01484850
    sources = [root / "n01440764" / "n01440764_0.png", root / "n01440764" / "n01440764_1.png",
               root / "n01443537" / "n01443537_0.png", root / "n01484850" / "n01484850_0.png"]
    for stored, source in zip(images, sources):
        want, _ = crop_image(Image.open(source).convert("RGB"), crop, 64)
        assert np.array_equal(stored, np.array(want).transpose(2, 0, 1))
    report = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert report["ok"] and report["summary"]["label_dim"] == 3


@pytest.mark.slow
def test_cifar_tarball_becomes_the_archive_fastgen_reads(tmp_path) -> None:
    from diffprep.phases.pipeline import run

    tarball = tmp_path / "cifar-10-python.tar.gz"
    images, labels = write_cifar(tarball)
    out = tmp_path / "cifar"
    # Neither --image-format nor --image-size: the layout's PNGs at CIFAR-10's own 32 px (compared pixel for pixel).
    settings = command_settings("--source-type", "cifar10", "--input-path", str(tarball), "--layout", "edm-zip",
                                "--output-dir", str(out), "--shard-size", "2", "--train-split", "1.0",
                                "--decode-workers", "1")
    assert run(settings, "raw", ask=never).samples == 10
    files, stored, read_labels = fastgen_read(out / contract.EDM_ZIP)
    want = np.concatenate([images[f"data_batch_{b}"] for b in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert np.array_equal(stored, want)
    assert read_labels.tolist() == [v for b in range(1, 6) for v in labels[f"data_batch_{b}"]]
    report = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert report["ok"] and report["summary"]["label_dim"] == 10


def test_validation_refuses_a_label_width_other_than_the_sources_classes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from diffprep.encodings.edm_zip import check_archive, write_archive

    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, format="png", compress_level=0, optimize=False)
    path = tmp_path / contract.EDM_ZIP
    write_archive(path, iter([(contract.edm_zip_name(i), png.getvalue(), i) for i in range(9)]))
    checks, summary = check_archive(path, SimpleNamespace(source={"classes": 10}, expected=RAW_PNG), 9)
    failed = [c for c in checks if not c.ok]
    assert summary["label_dim"] == 9 and [c.name for c in failed] == ["labels"]
    assert "max(label)+1 is 9, the source has 10 classes" in failed[0].detail
    assert all(c.ok for c in check_archive(path, SimpleNamespace(source={"classes": 9}, expected=RAW_PNG), 9)[0])
    # --num-classes (recorded in the plan's settings) is the width asked for, whatever the source says.
    asked = SimpleNamespace(source={"classes": 9}, settings={"num_classes": 1000}, expected=RAW_PNG)
    failed = [c for c in check_archive(path, asked, 9)[0] if not c.ok]
    assert [c.name for c in failed] == ["labels"] and "--num-classes is 1000" in failed[0].detail
    unlabeled = tmp_path / "unlabeled.zip"
    write_archive(unlabeled, iter([(contract.edm_zip_name(i), png.getvalue(), None) for i in range(2)]))
    checks = check_archive(unlabeled, SimpleNamespace(source={}, settings={"num_classes": 10}, expected=RAW_PNG), 2)[0]
    assert [c.name for c in checks if not c.ok] == ["labels"]
    assert all(c.ok for c in check_archive(unlabeled, SimpleNamespace(source={}, expected=RAW_PNG), 2)[0])
