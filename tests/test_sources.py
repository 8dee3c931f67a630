"""Source readers on real files: folders of PNG/JPEG files, Hugging Face datasets built locally, tar shards."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from diffprep.config import SourceConfig  # noqa: E402
from diffprep.errors import SourceError  # noqa: E402
from diffprep.sources import Source, SourceSample, open_source  # noqa: E402
from diffprep.sources.base import escape_id, unescape_id  # noqa: E402
from diffprep.sources.webdataset import split_member_name  # noqa: E402


def image_bytes(color: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (color, 255 - color, 0)).save(buf, format=fmt)
    return buf.getvalue()


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def read_all(source: Source) -> dict[str, SourceSample]:
    assert isinstance(source, Source)
    json.dumps(source.describe())
    ids = list(source.list_ids())
    samples = list(source.read(ids))
    assert [s.source_id for s in samples] == ids
    assert all("\n" not in i for i in ids) and len(set(ids)) == len(ids)
    return {s.source_id: s for s in samples}


def reason(sample: SourceSample) -> str | None:
    if sample.reject is not None:
        assert sample.reject.phase == "read"
        return sample.reject.reason
    return None


# --- directory -----------------------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    files = {
        "a.jpg": image_bytes(1, "JPEG"), "a.png": image_bytes(2), "B.JPG": image_bytes(3, "JPEG"),
        "c.Png": image_bytes(4), "d.webp": image_bytes(5, "WEBP"), "sub/deep/e.jpeg": image_bytes(6, "JPEG"),
        "orphan.jpg": image_bytes(7), "bad.png": image_bytes(8), "empty.png": image_bytes(9),
        "bom.png": image_bytes(10),
    }
    for name, data in files.items():
        write(root / "images" / name, data)
    write(root / "images" / "notes.md", "not an image")
    captions = {
        "a": "an a", "B": "a b", "c": "a c", "d": "a d", "sub/deep/e": "nested e", "bad": b"ok\xff\xfe",
        "empty": "", "bom": b"\xef\xbb\xbf  caption with bom \n", "lonely": "no image", "sub/lonely2": "none",
    }
    for stem, text in captions.items():
        write(root / "captions" / f"{stem}.txt", text)
    return root


def directory(root: Path):
    return open_source(SourceConfig(type="directory", input_dir=str(root)))


def test_directory_pairs_images_and_captions(folder: Path) -> None:
    samples = read_all(directory(folder))
    assert sorted(samples) == sorted([
        "B.JPG", "a.jpg", "a.png", "bad.png", "bom.png", "c.Png", "d.webp", "empty.png", "orphan.jpg",
        "sub/deep/e.jpeg", "caption-only:lonely.txt", "caption-only:sub/lonely2.txt", "other:images/notes.md",
    ])
    assert reason(samples["other:images/notes.md"]) == "unsupported_format"
    assert samples["a.jpg"].caption == samples["a.png"].caption == "an a"  # same stem, both pair with a.txt
    assert samples["a.png"].image == (folder / "images/a.png").read_bytes()
    assert (samples["B.JPG"].caption, samples["c.Png"].caption, samples["d.webp"].caption) == ("a b", "a c", "a d")
    assert samples["sub/deep/e.jpeg"].caption == "nested e"
    assert samples["bom.png"].caption == "caption with bom"
    assert samples["empty.png"].caption == "" and samples["empty.png"].reject is None

    assert reason(samples["orphan.jpg"]) == "missing_caption"
    assert samples["orphan.jpg"].image == (folder / "images/orphan.jpg").read_bytes()
    assert reason(samples["caption-only:lonely.txt"]) == "missing_image"
    assert reason(samples["caption-only:sub/lonely2.txt"]) == "missing_image"
    bad = samples["bad.png"]
    assert reason(bad) == "caption_decode_error" and bad.caption is None and "byte offset 2" in bad.reject.detail
    ok = [i for i, s in samples.items() if s.reject is None]
    assert len(ok) == 8 and all(samples[i].image for i in ok)


def test_directory_order_is_bytewise_and_stable(tmp_path: Path) -> None:
    root = tmp_path / "d"
    names = ["a.jpg", "a-b.jpg", "a/x.jpg", "Z.jpg", "é.jpg", "a/b/y.png", "new\nline.jpg", "100%.jpg"]
    for name in names:
        write(root / "images" / name, image_bytes(0))
        write(root / "captions" / (os.path.splitext(name)[0] + ".txt"), name)
    write(root / "captions" / "a.b.txt", "caption only")
    source = directory(root)
    ids = list(source.list_ids())
    assert ids == list(directory(root).list_ids())
    assert ids == sorted(ids, key=lambda i: i.encode())
    assert ids.index("a-b.jpg") < ids.index("a.jpg") < ids.index("a/b/y.png") < ids.index("a/x.jpg")
    assert "caption-only:a.b.txt" in ids and "new%0Aline.jpg" in ids and "100%25.jpg" in ids
    samples = read_all(source)
    assert samples["new%0Aline.jpg"].caption == "new\nline.jpg"
    assert samples["100%25.jpg"].caption == "100%.jpg"
    assert unescape_id(escape_id("x\n%\udcff/ü")) == "x\n%\udcff/ü"


def test_directory_read_follows_given_order_and_reports_deleted_files(folder: Path) -> None:
    source = directory(folder)
    ids = list(source.list_ids())
    (folder / "images/a.png").unlink()
    (folder / "captions/lonely.txt").unlink()
    wanted = ["d.webp", "a.png", "caption-only:lonely.txt", "a.jpg"]
    samples = list(source.read(wanted))
    assert [s.source_id for s in samples] == wanted and set(wanted) <= set(ids)
    assert [reason(s) for s in samples] == [None, "source_missing", "source_missing", None]
    with pytest.raises(ValueError, match="not an id"):
        list(source.read(["../secret.jpg"]))


def test_directory_missing_folders_are_source_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="is not a folder"):
        directory(tmp_path / "nope")
    (tmp_path / "images").mkdir()
    with pytest.raises(SourceError, match="no captions/ folder"):
        directory(tmp_path)
    with pytest.raises(SourceError, match="input_dir is not set"):
        open_source(SourceConfig(type="directory"))


# --- huggingface ---------------------------------------------------------------


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def hf_rows() -> dict:
    images = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(5)]
    images[2] = None
    return {
        "image": images,
        "text": ["a cat", "  a dog ", "no image", None, "last"],
        "meta": [json.dumps({"prompt": f"p{i}"}) for i in range(5)],
        "tags": [["first", "second"], [], ["t2"], ["t3"], ["t4"]],
    }


HF_FEATURES = datasets.Features({
    "image": datasets.Image(), "text": datasets.Value("string"), "meta": datasets.Value("string"),
    "tags": datasets.List(datasets.Value("string")),
})


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "saved"
    datasets.Dataset.from_dict(hf_rows(), features=HF_FEATURES).save_to_disk(str(path))
    return path


def hf(dataset: str, **settings):
    return open_source(SourceConfig(type="huggingface", hf_dataset=dataset, **settings))


def pixel(data: bytes) -> tuple:
    return Image.open(io.BytesIO(data)).getpixel((0, 0))


def check_hf_rows(samples: dict[str, SourceSample]) -> None:
    assert list(samples) == [f"train/{i}" for i in range(5)]
    assert [reason(s) for s in samples.values()] == [None, None, "missing_image", "missing_caption", None]
    assert [s.caption for s in samples.values()] == ["a cat", "a dog", None, None, "last"]
    assert pixel(samples["train/1"].image) == (40, 0, 0) and pixel(samples["train/4"].image) == (160, 0, 0)


def test_hf_save_to_disk_autodetects_keys(saved: Path) -> None:
    source = hf(str(saved))
    assert (source.image_key, source.caption_key) == ("image", "text")
    check_hf_rows(read_all(source))
    assert source.describe() == {
        "type": "huggingface", "dataset": str(saved), "split": "train", "data_files": None, "revision": None,
        "streaming": False, "image_key": "image", "video_key": None, "caption_key": "text", "caption_template": None,
        "class_names": None,
    }
    picked = list(source.read(["train/4", "train/0", "train/9"]))
    assert [s.caption for s in picked] == ["last", "a cat", None]
    assert reason(picked[2]) == "source_missing"


def test_hf_class_labels_become_captions(tmp_path: Path) -> None:
    images = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(4)]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["tench", "goldfish", "great white shark"]),
                                  "coarse": datasets.Value("int64")})
    path = tmp_path / "imagenet-like"
    datasets.Dataset.from_dict({"image": images, "label": [2, 0, 1, 2], "coarse": [0, 1, 5, 1]},
                               features=features).save_to_disk(str(path))

    # A ClassLabel column is found without a name and captioned with its own class names, through the template.
    source = hf(str(path), caption_template="a photo of a {label}")
    assert source.caption_key == "label"
    assert [s.caption for s in read_all(source).values()] == [
        "a photo of a great white shark", "a photo of a tench", "a photo of a goldfish",
        "a photo of a great white shark"]
    assert [s.caption for s in read_all(hf(str(path))).values()][:2] == ["great white shark", "tench"]
    # The label itself travels too (meta.json's label and class_name; edm-zip's dataset.json).
    assert [(s.label, s.class_name) for s in read_all(source).values()][:2] == [(2, "great white shark"), (0, "tench")]
    # Its class count is the source's, as the class folders' and CIFAR-10's are: edm-zip's label-width check.
    assert source.describe()["classes"] == 3

    # An integer column takes its names from a file; a label past the names is a named reject.
    names = tmp_path / "coarse.txt"
    names.write_text("fish\nshark\n")
    coarse = read_all(hf(str(path), caption_key="coarse", class_names=str(names), caption_template="{label} in water"))
    assert [s.caption for s in coarse.values()] == ["fish in water", "shark in water", None, "shark in water"]
    assert reason(coarse["train/2"]) == "invalid_caption"
    assert "class label 5 is not one of the 2 class names (0..1)" in coarse["train/2"].reject.detail
    unnamed = read_all(hf(str(path), caption_key="coarse"))
    assert {reason(s) for s in unnamed.values()} == {"invalid_caption"}
    assert "--class-names FILE" in unnamed["train/0"].reject.detail
    for template in ("a photo", "a {label} of {thing}"):
        with pytest.raises(SourceError, match="must hold {label}"):
            hf(str(path), caption_template=template)


def test_hf_dotted_json_key_and_list_caption(saved: Path) -> None:
    by_json = read_all(hf(str(saved), caption_key="meta.prompt"))
    assert [s.caption for s in by_json.values()] == ["p0", "p1", None, "p3", "p4"]
    by_list = read_all(hf(str(saved), caption_key="tags"))
    assert [s.caption for s in by_list.values()] == ["first", None, None, "t3", "t4"]  # first of the list
    assert reason(by_list["train/1"]) == "missing_caption"
    assert reason(read_all(hf(str(saved), caption_key="meta.nothing"))["train/0"]) == "missing_caption"


def test_hf_unknown_keys_list_the_columns(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"caption_key 'prompt' matches no column.*'image', 'text', 'meta', 'tags'"):
        hf(str(saved), caption_key="prompt")
    plain = tmp_path / "plain"
    datasets.Dataset.from_dict({"pic": [b"x"], "words": ["w"]}).save_to_disk(str(plain))
    with pytest.raises(SourceError, match=r"no image or video column found.*\['pic', 'words'\]"):
        hf(str(plain))
    with pytest.raises(SourceError, match=r"no caption column found.*\['pic', 'words'\]"):
        hf(str(plain), image_key="pic")
    assert read_all(hf(str(plain), image_key="pic", caption_key="words"))["train/0"].image == b"x"
    with pytest.raises(SourceError, match="cannot load the Hugging Face dataset"):
        hf(str(tmp_path / "missing"))


def test_hf_dataset_dict_splits(tmp_path: Path) -> None:
    path = tmp_path / "dict"
    ds = datasets.Dataset.from_dict(hf_rows(), features=HF_FEATURES)
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(str(path))
    assert list(hf(str(path), hf_split="test").list_ids()) == ["test/0", "test/1"]
    with pytest.raises(SourceError, match=r"'val' is not in .*\['train', 'test'\]"):
        hf(str(path), hf_split="val")


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict(hf_rows(), features=HF_FEATURES).to_parquet(str(path))
    return path


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_parquet_mapped_and_streaming(parquet: Path, streaming: bool) -> None:
    source = hf("parquet", hf_data_files=str(parquet), hf_streaming=streaming)
    assert source.describe()["streaming"] is streaming
    check_hf_rows(read_all(source))
    assert [s.caption for s in source.read(["train/1", "train/4"])] == ["a dog", "last"]
    assert [reason(s) for s in source.read(["train/4", "train/5"])] == [None, "source_missing"]
    assert read_all(hf("parquet", hf_data_files=str(parquet), hf_streaming=streaming,
                       caption_key="meta.prompt"))["train/4"].caption == "p4"


def test_hf_imagefolder_reads_image_files_by_path(tmp_path: Path) -> None:
    root = tmp_path / "imagefolder"
    for i in range(2):
        write(root / f"{i}.png", image_bytes(i * 100))
    write(root / "metadata.jsonl", "".join(json.dumps({"file_name": f"{i}.png", "text": f"t{i}"}) + "\n"
                                         for i in range(2)))
    samples = read_all(hf(str(root)))
    assert [s.caption for s in samples.values()] == ["t0", "t1"]
    assert samples["train/1"].image == (root / "1.png").read_bytes()


# --- webdataset ----------------------------------------------------------------


def make_tar(path: Path, members: list[tuple[str, bytes | None]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


JPG, PNG = image_bytes(1, "JPEG"), image_bytes(2)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    folder.mkdir()
    make_tar(folder / "shard-000.tar", [
        ("__meta__", b"skipped"), ("README", b"no dot: not a sample"), ("dir", None),
        ("a.jpg", JPG), ("a.txt", b" first \n"),
        ("b.PNG", PNG), ("b.json", json.dumps({"prompt": "from json"}).encode()),
        ("dir/c.webp", PNG), ("dir/c.caption", b"nested"),
        ("img.001.jpg", JPG), ("img.001.txt", b"dotted"),
        ("../evil.jpg", JPG), ("../evil.txt", b"x"), ("/abs.jpg", JPG), ("/abs.txt", b"x"),
        ("noimg.txt", b"text"), ("nocap.jpg", JPG), ("bad.jpg", JPG), ("bad.txt", b"ok\xc3("),
        ("dup.jpg", JPG), ("dup.txt", b"d"), ("dup.JPG", JPG),
        ("a.json", b'{"prompt": "late member of a"}'),
    ])
    make_tar(folder / "shard-001.tar", [("a.jpg", PNG), ("a.txt", b"second shard")])
    return folder


def wds(pattern: str, **keys):
    return open_source(SourceConfig(type="webdataset", input_path=pattern, **keys))


def test_webdataset_keys_and_samples(shards: Path) -> None:
    source = wds(str(shards / "shard-*.tar"))
    samples = read_all(source)
    s0 = "shard-000.tar/"
    assert list(samples) == [s0 + k for k in ("a", "b", "dir/c", "img", "../evil", "/abs", "noimg", "nocap", "bad",
                                              "dup")] + ["shard-001.tar/a"]
    assert (samples[s0 + "a"].image, samples[s0 + "a"].caption) == (JPG, "first")
    assert (samples[s0 + "b"].image, samples[s0 + "b"].caption) == (PNG, "from json")
    assert samples[s0 + "dir/c"].caption == "nested"
    assert (samples["shard-001.tar/a"].image, samples["shard-001.tar/a"].caption) == (PNG, "second shard")
    assert {k[len(s0):]: reason(s) for k, s in samples.items() if reason(s)} == {
        "img": "missing_image",  # webdataset's rule: key "img", extension "001.jpg"
        "../evil": "unsafe_member_path", "/abs": "unsafe_member_path", "noimg": "missing_image",
        "nocap": "missing_caption", "bad": "caption_decode_error", "dup": "duplicate_member",
    }
    assert "byte offset 2" in samples[s0 + "bad"].reject.detail
    assert source.describe()["num_shards"] == 2


def test_webdataset_explicit_keys_and_brace_expansion(shards: Path) -> None:
    dotted = read_all(wds(str(shards / "shard-{000..001}.tar"), image_key="001.JPG", caption_key="001.txt"))
    assert (dotted["shard-000.tar/img"].image, dotted["shard-000.tar/img"].caption) == (JPG, "dotted")
    assert reason(dotted["shard-000.tar/a"]) == "missing_image"
    by_json = read_all(wds(str(shards / "*.tar"), caption_key="json.prompt"))
    assert by_json["shard-000.tar/a"].caption == "late member of a"  # members of a key need not be adjacent
    assert reason(by_json["shard-001.tar/a"]) == "missing_caption"


def test_webdataset_read_order_and_vanished_data(shards: Path) -> None:
    source = wds(str(shards / "*.tar"))
    wanted = ["shard-001.tar/a", "shard-000.tar/dir/c", "shard-000.tar/a"]
    assert [(s.source_id, s.caption) for s in source.read(wanted)] == [
        ("shard-001.tar/a", "second shard"), ("shard-000.tar/dir/c", "nested"), ("shard-000.tar/a", "first")]
    (shards / "shard-001.tar").unlink()
    make_tar(shards / "shard-000.tar", [("a.jpg", JPG), ("a.txt", b"rewritten")])
    got = list(source.read(wanted))
    assert [reason(s) for s in got] == ["source_missing", "source_missing", None] and got[2].caption == "rewritten"


def test_webdataset_grouping_matches_webdataset(tmp_path: Path) -> None:
    import webdataset

    names = ["__meta__", "__key__.txt", "__dir__/x.txt", "README", "a.jpg", "a.txt", "d/img.001.jpg",
             "x.y/z.Tar.GZ", ".hidden.jpg", "sub/__k__.txt", "sub/.dot.txt"]
    make_tar(tmp_path / "rule.tar", [(name, b"x") for name in names])
    expected = [s["__key__"] for s in webdataset.WebDataset(str(tmp_path / "rule.tar"), shardshuffle=False)]
    assert [i.split("/", 1)[1] for i in wds(str(tmp_path / "rule.tar")).list_ids()] == expected
    assert split_member_name("d/img.001.JPG") == ("d/img", "001.jpg")
    write(tmp_path / "corrupt.tar", b"not a tar file" * 100)
    with pytest.raises(SourceError, match="cannot list shard .*corrupt.tar"):
        list(wds(str(tmp_path / "corrupt.tar")).list_ids())
    assert reason(next(wds(str(tmp_path / "corrupt.tar")).read(["corrupt.tar/a"]))) == "source_read_error"
    with pytest.raises(SourceError, match="matches no file"):
        wds(str(tmp_path / "none-*.tar"))
    with pytest.raises(SourceError, match="local tar files or s3:// URLs"):
        wds("gs://bucket/*.tar")


def test_every_file_in_the_folders_is_a_sample_or_a_named_reject(tmp_path: Path) -> None:
    root = tmp_path / "data"
    gif = io.BytesIO()
    Image.new("P", (8, 8)).save(gif, format="GIF")
    for name, data in {"anim.gif": gif.getvalue(), "photo.heic": b"ftypheic", "capup.jpg": image_bytes(1, "JPEG"),
                       "a.jpg": image_bytes(2, "JPEG"), "clip.mp4": b"x", ".DS_Store": b"x", "Thumbs.db": b"x"
                       }.items():
        write(root / "images" / name, data)
    for name, text in {"anim.txt": "anim", "photo.txt": "p", "capup.TXT": "upper", "a.txt": "a", "a.TXT": "A",
                       "readme.md": "r", "lonely.Txt": "l"}.items():
        write(root / "captions" / name, text)
    ids = list(directory(root).list_ids())
    assert ids == ["a.jpg", "anim.gif", "caption-only:lonely.Txt", "caption-only:photo.txt", "capup.jpg",
                   "other:captions/a.TXT", "other:captions/readme.md", "other:images/clip.mp4",
                   "other:images/photo.heic"]
    samples = read_all(directory(root))
    assert samples["anim.gif"].reject is None and samples["anim.gif"].caption == "anim"  # GIF: an image
    assert samples["capup.jpg"].reject is None and samples["capup.jpg"].caption == "upper"  # any letter case
    assert samples["a.jpg"].caption == "a"  # .txt is the caption; a.TXT is named
    assert reason(samples["other:captions/a.TXT"]) == "duplicate_caption"
    assert "captions/a.txt" in samples["other:captions/a.TXT"].reject.detail
    heic = samples["other:images/photo.heic"].reject
    assert heic.reason == "unsupported_format" and ".heic" in heic.detail and ".jpg" in heic.detail
    assert ".mp4" in heic.detail and ".txt" in heic.detail  # the formats that are read
    assert "videos/" in samples["other:images/clip.mp4"].reject.detail
    assert reason(samples["other:captions/readme.md"]) == "unsupported_format"
    assert reason(samples["caption-only:lonely.Txt"]) == "missing_image"


def test_unsupported_members_and_rows_are_named(tmp_path: Path) -> None:
    make_tar(tmp_path / "s.tar", [("p.heic", b"x"), ("p.txt", b"a photo"), ("n.txt", b"no media")])
    samples = read_all(wds(str(tmp_path / "s.tar")))
    heic = samples["s.tar/p"].reject
    assert heic.reason == "unsupported_format" and "heic" in heic.detail and ".jpg" in heic.detail
    assert reason(samples["s.tar/n"]) == "missing_image"
    (tmp_path / "meta.jsonl").write_text(json.dumps({"image": "photo.heic", "caption": "c"}) + "\n")
    (tmp_path / "photo.heic").write_bytes(b"x")
    source = open_source(SourceConfig(type="metadata", metadata_file=str(tmp_path / "meta.jsonl")))
    (row,) = source.read(list(source.list_ids()))
    assert row.reject.reason == "unsupported_format" and ".png" in row.reject.detail
