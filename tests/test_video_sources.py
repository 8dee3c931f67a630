"""Video in the sources: clips under videos/, metadata files (JSON, JSONL, CSV), mp4/webm tar members, HF Video
columns; on disk and from a real S3 endpoint on loopback (moto, tests/s3_store.py). Clips are real files of a few
frames at 32 px written here with PyAV (a few kB each)."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import av  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from diffprep.config import SourceConfig  # noqa: E402
from diffprep.errors import SourceError  # noqa: E402
from diffprep.media.video import probe  # noqa: E402
from diffprep.sources import Source, SourceSample, open_source  # noqa: E402

BUCKET = "diffprep-vsrc"  # created by the admin fixture (conftest.py)
CONTAINERS = {"mp4": ("mp4", "libx264"), "webm": ("webm", "libvpx"), "mov": ("mov", "libx264"),
              "mkv": ("matroska", "libx264")}


def clip(ext: str = "mp4", level: int = 0, frames: int = 3) -> bytes:
    """A real clip of ``frames`` 32x32 frames whose grey level starts at ``level`` (tells clips apart)."""
    fmt, codec = CONTAINERS[ext.lower()]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=8)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((32, 32, 3), (level + 40 * i) % 256, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def image_bytes(color: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (color, 255 - color, 0)).save(buf, format=fmt)
    return buf.getvalue()


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def read_all(source: Source) -> dict[str, SourceSample]:
    assert isinstance(source, Source)
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


def outcome(sample: SourceSample) -> tuple:
    """What a sample is, wherever it was read from (reject details name the location, so only the reason)."""
    return sample.image, sample.video, sample.caption, reason(sample)


def upload(admin, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            admin.put_object(Bucket=BUCKET, Key=prefix + path.relative_to(local).as_posix(), Body=path.read_bytes())


def unique_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}/"


MP4, WEBM = clip("mp4", 0), clip("webm", 100)


def test_written_clips_are_real() -> None:
    for ext in CONTAINERS:
        assert probe(clip(ext)).frames == 3


# --- directory: videos/ ---------------------------------------------------------------------------


def write_video_folder(root: Path, *, with_images: bool = True) -> Path:
    files = {
        "videos/a.mp4": MP4, "videos/B.WEBM": WEBM, "videos/sub/deep/c.Mov": clip("mov", 20),
        "videos/d.mkv": clip("mkv", 30), "videos/orphan.mp4": clip("mp4", 40), "videos/bad.mp4": clip("mp4", 50),
        "videos/notes.md": b"not a clip", "videos/anim.gif": b"GIF89a not a sample",
        "captions/a.txt": b"clip a", "captions/B.txt": b"\xef\xbb\xbf clip b \n", "captions/sub/deep/c.txt": b"nested",
        "captions/d.txt": b"", "captions/bad.txt": b"ok\xff", "captions/lonely.txt": b"no media",
        "captions/sub/lonely2.txt": b"none",
    }
    if with_images:
        files |= {"images/a.jpg": image_bytes(1, "JPEG"), "images/e.png": image_bytes(2), "captions/e.txt": b"image e",
                  "images/sub/f.png": image_bytes(3), "captions/sub/f.txt": b"image f"}
    for name, data in files.items():
        write(root / name, data)
    return root


def directory(root: Path | str, **fields) -> Source:
    return open_source(SourceConfig(type="directory", input_dir=str(root), **fields))


def test_directory_reads_videos_beside_images(tmp_path: Path) -> None:
    root = write_video_folder(tmp_path / "data")
    source = directory(root)
    ids = list(source.list_ids())
    samples_ids = [i for i in ids if not i.startswith("other:")]
    assert samples_ids == sorted(samples_ids, key=str.encode)  # one bytewise-sorted listing over both folders
    assert ids[len(samples_ids):] == ["other:videos/anim.gif", "other:videos/notes.md"]  # then the other files
    samples = read_all(source)
    assert list(samples) == [
        "B.WEBM", "a.jpg", "a.mp4", "bad.mp4", "caption-only:lonely.txt", "caption-only:sub/lonely2.txt", "d.mkv",
        "e.png", "orphan.mp4", "sub/deep/c.Mov", "sub/f.png", "other:videos/anim.gif", "other:videos/notes.md",
    ]
    assert "move it to images/" in samples["other:videos/anim.gif"].reject.detail  # a GIF is an image
    # Clips carry video bytes and no image; images are read exactly as before.
    assert (samples["a.mp4"].video, samples["a.mp4"].image, samples["a.mp4"].caption) == (MP4, None, "clip a")
    assert samples["a.mp4"].media == MP4
    assert (samples["B.WEBM"].video, samples["B.WEBM"].caption) == (WEBM, "clip b")  # BOM dropped, stripped
    assert samples["sub/deep/c.Mov"].video == (root / "videos/sub/deep/c.Mov").read_bytes()
    assert samples["sub/deep/c.Mov"].caption == "nested"
    assert samples["d.mkv"].caption == "" and samples["d.mkv"].reject is None  # an empty caption is kept
    assert samples["a.jpg"].image == (root / "images/a.jpg").read_bytes() and samples["a.jpg"].video is None
    assert samples["a.jpg"].caption == "clip a"  # same stem as a.mp4: both captioned by a.txt
    assert (samples["sub/f.png"].caption, samples["e.png"].caption) == ("image f", "image e")

    assert {i: reason(s) for i, s in samples.items() if s.reject} == {
        "bad.mp4": "caption_decode_error", "caption-only:lonely.txt": "missing_image",
        "caption-only:sub/lonely2.txt": "missing_image", "orphan.mp4": "missing_caption",
        "other:videos/anim.gif": "unsupported_format", "other:videos/notes.md": "unsupported_format",
    }
    assert samples["orphan.mp4"].video == (root / "videos/orphan.mp4").read_bytes()  # kept for the report
    assert samples["bad.mp4"].video is not None and "byte offset 2" in samples["bad.mp4"].reject.detail
    assert "no clip videos/lonely.{mp4,webm,mov,mkv}" in samples["caption-only:lonely.txt"].reject.detail


def test_directory_videos_only_and_vanished_clips(tmp_path: Path) -> None:
    root = write_video_folder(tmp_path / "data", with_images=False)
    source = directory(root)
    samples = read_all(source)
    assert [i for i, s in samples.items() if s.reject is None] == ["B.WEBM", "a.mp4", "d.mkv", "sub/deep/c.Mov"]
    assert all(s.image is None for s in samples.values())
    (root / "videos/a.mp4").unlink()
    (root / "captions/d.txt").unlink()
    got = list(source.read(["d.mkv", "a.mp4", "B.WEBM"]))
    assert [reason(s) for s in got] == ["missing_caption", "source_missing", None]
    assert str(root / "videos/a.mp4") in got[1].reject.detail
    with pytest.raises(ValueError, match="not an id"):
        list(source.read(["../x.mp4"]))


def test_directory_needs_media_and_captions(tmp_path: Path) -> None:
    write(tmp_path / "captions/a.txt", "a")
    with pytest.raises(SourceError, match=r"no images/ or videos/ folder.*videos/<name>.mp4"):
        directory(tmp_path)
    (tmp_path / "videos").mkdir()
    assert list(directory(tmp_path).list_ids()) == ["caption-only:a.txt"]
    (tmp_path / "captions/a.txt").unlink()
    # The folders are there but empty: the listing says where it looked and what it looks for.
    with pytest.raises(SourceError, match=rf"{tmp_path} holds no media file and no caption; .*captions/<name>.txt"):
        list(directory(tmp_path).list_ids())
    (tmp_path / "captions").rmdir()
    with pytest.raises(SourceError, match="no captions/ folder"):
        directory(tmp_path)


@pytest.mark.usefixtures("aws_env")
def test_directory_videos_under_prefix_equal_local(admin, proxy, tmp_path: Path) -> None:
    root = write_video_folder(tmp_path / "data")
    write(root / "videos/x.k.mp4", clip("mp4", 60))  # a stem that is another stem plus a dot
    write(root / "captions/x.k.txt", "dotted x")
    write(root / "videos/x.mp4", clip("mp4", 70))
    write(root / "captions/x.txt", "plain x")
    write(root / "captions/y.mp4.txt", "no y.mp4.* clip")
    prefix = unique_prefix() + "data"
    upload(admin, root, prefix + "/")
    local = read_all(directory(root))
    source = directory(f"s3://{BUCKET}/{prefix}", s3_endpoint_url=proxy.url)
    remote = read_all(source)
    assert list(remote) == list(local)
    assert {i: outcome(s) for i, s in remote.items()} == {i: outcome(s) for i, s in local.items()}
    assert (remote["x.mp4"].caption, remote["x.k.mp4"].caption) == ("plain x", "dotted x")
    assert reason(remote["caption-only:y.mp4.txt"]) == "missing_image"

    # Only images/ and videos/ holding objects are listed; videos only is a dataset too.
    only = unique_prefix() + "v"
    upload(admin, write_video_folder(tmp_path / "v", with_images=False), only + "/")
    proxy.reset()
    clips = read_all(directory(f"s3://{BUCKET}/{only}", s3_endpoint_url=proxy.url))
    assert [i for i, s in clips.items() if s.reject is None] == ["B.WEBM", "a.mp4", "d.mkv", "sub/deep/c.Mov"]
    assert len([r for r in proxy.log if r.method == "GET" and "images" in r.query]) == 1  # the probe, no listing

    admin.delete_object(Bucket=BUCKET, Key=f"{prefix}/videos/a.mp4")
    got = list(source.read(["a.mp4", "a.jpg"]))
    assert [reason(s) for s in got] == ["source_missing", None]
    assert f"s3://{BUCKET}/{prefix}/videos/a.mp4 no longer exists" in got[0].reject.detail

    empty = unique_prefix()
    admin.put_object(Bucket=BUCKET, Key=empty + "captions/a.txt", Body=b"a")
    with pytest.raises(SourceError, match=rf"no object under s3://{BUCKET}/{empty}images/ or .*videos/"):
        directory(f"s3://{BUCKET}/{empty}", s3_endpoint_url=proxy.url)


# --- metadata file (the LTX trainer's dataset.json convention) ------------------------------------------


def write_media(root: Path) -> Path:
    """Media files under ``root`` for the metadata tests; the metadata files go in ``root/meta``."""
    write(root / "meta/clips/a.mp4", MP4)
    write(root / "meta/clips/b.webm", WEBM)
    write(root / "meta/pics/p.png", image_bytes(9))
    write(root / "meta/clips/#hash.mp4", clip("mp4", 90))
    write(root / "shared/up.mkv", clip("mkv", 80))  # reached with ../ from the metadata file's folder
    (root / "meta/clips/folder.mp4").mkdir()  # a path that is a folder: unreadable
    return root / "meta"


ROWS = [
    {"caption": " clip a ", "media_path": "clips/a.mp4"},
    {"caption": "clip b", "media_path": "clips/b.webm"},
    {"caption": "a picture", "media_path": "pics/p.png"},  # an image path gives an image sample
    {"caption": "a again", "media_path": "clips/a.mp4"},  # the same path twice: the second id has its row
    {"caption": "gone", "media_path": "clips/missing.mp4"},
    {"media_path": "clips/b.webm"},  # no caption
    {"caption": None, "media_path": "clips/a.mp4"},
    {"caption": "no path"},
    {"caption": "not text", "media_path": 7},
    {"caption": 7, "media_path": "clips/b.webm"},
    {"caption": ["first", "second"], "media_path": "../shared/up.mkv"},
    {"caption": "", "media_path": "clips/#hash.mp4"},
    {"caption": "a folder", "media_path": "clips/folder.mp4"},
]
IDS = ["clips/a.mp4", "clips/b.webm", "pics/p.png", "clips/a.mp4#4", "clips/missing.mp4", "clips/b.webm#6",
       "clips/a.mp4#7", "#8", "#9", "clips/b.webm#10", "../shared/up.mkv", "clips/%23hash.mp4", "clips/folder.mp4"]
REASONS = {"clips/missing.mp4": "media_not_found", "clips/b.webm#6": "missing_caption",
           "clips/a.mp4#7": "missing_caption", "#8": "missing_media", "#9": "invalid_media_path",
           "clips/b.webm#10": "invalid_caption", "clips/folder.mp4": "source_read_error"}


def metadata(path: Path | str, **fields) -> Source:
    return open_source(SourceConfig(type="metadata", metadata_file=str(path), **fields))


def check_rows(samples: dict[str, SourceSample], folder: Path) -> None:
    assert list(samples) == IDS
    assert {i: reason(s) for i, s in samples.items() if s.reject} == REASONS
    a = samples["clips/a.mp4"]
    assert (a.video, a.image, a.caption) == (MP4, None, "clip a")
    assert (samples["clips/a.mp4#4"].video, samples["clips/a.mp4#4"].caption) == (MP4, "a again")
    assert samples["clips/b.webm"].video == WEBM
    p = samples["pics/p.png"]
    assert (p.image, p.video, p.caption) == ((folder / "pics/p.png").read_bytes(), None, "a picture")
    up = samples["../shared/up.mkv"]
    assert (up.video, up.caption) == ((folder.parent / "shared/up.mkv").read_bytes(), "first")
    assert samples["clips/%23hash.mp4"].caption == "" and samples["clips/%23hash.mp4"].reject is None
    assert samples["clips/b.webm#6"].video == WEBM  # media read before the caption was found missing


def test_metadata_json_jsonl_and_csv_give_the_same_samples(tmp_path: Path) -> None:
    import csv
    import json

    folder = write_media(tmp_path)
    (folder / "dataset.json").write_text(json.dumps(ROWS, indent=1))
    # JSONL with a BOM and blank lines
    (folder / "dataset.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n\n".join(json.dumps(r) for r in ROWS).encode())
    source = metadata(folder / "dataset.json")
    json_samples = read_all(source)
    check_rows(json_samples, folder)
    assert "dataset.json row 6: the row" not in json_samples["clips/b.webm#6"].reject.detail
    assert f"{folder / 'dataset.json'} row 6 column 'caption'" in json_samples["clips/b.webm#6"].reject.detail
    assert source.describe() == {"type": "metadata", "metadata_file": str(folder / "dataset.json"),
                                 "caption_key": "caption", "image_key": None, "video_key": "media_path",
                                 "s3_endpoint_url": None, "s3_profile": None, "columns": ["caption", "media_path"]}
    jsonl = read_all(metadata(folder / "dataset.jsonl"))
    check_rows(jsonl, folder)
    assert "row 6 (line 11)" in jsonl["clips/b.webm#6"].reject.detail

    # CSV: no list captions or non-text values; an empty cell is an empty caption, a short row has none.
    with open(folder / "dataset.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["media_path", "caption"])
        writer.writerows([["clips/a.mp4", " clip a "], ["pics/p.png", "multi\nline"], ["clips/b.webm", ""],
                          ["clips/a.mp4"], ["", "no path"]])
    rows = read_all(metadata(folder / "dataset.csv"))
    assert list(rows) == ["clips/a.mp4", "pics/p.png", "clips/b.webm", "clips/a.mp4#4", "#5"]
    assert [s.caption for s in rows.values()] == ["clip a", "multi\nline", "", None, None]
    assert [reason(s) for s in rows.values()] == [None, None, None, "missing_caption", "missing_media"]
    assert rows["pics/p.png"].image is not None
    assert "row 4 (line 6)" in rows["clips/a.mp4#4"].reject.detail  # row 2's quoted caption spans two lines


def test_metadata_columns_default_and_rename(tmp_path: Path) -> None:
    import json

    folder = write_media(tmp_path)
    (folder / "video.jsonl").write_bytes(
        (json.dumps({"video": "clips/a.mp4", "caption": "v\u2028w"}, ensure_ascii=False) + "\r\n").encode())
    video = read_all(metadata(folder / "video.jsonl"))["clips/a.mp4"]
    assert (video.video, video.caption) == (MP4, "v\u2028w")  # CRLF lines; a U+2028 inside a caption is text
    # An image column: its paths are images, even without a known extension.
    write(folder / "pics/raw", image_bytes(3))
    (folder / "image.json").write_text(json.dumps([{"image": "pics/raw", "caption": "i"},
                                                   {"image": "clips/b.webm", "caption": "still a clip"}]))
    images = read_all(metadata(folder / "image.json"))
    assert images["pics/raw"].image == image_bytes(3) and images["pics/raw"].video is None
    assert images["clips/b.webm"].video == WEBM
    description = metadata(folder / "image.json").describe()
    assert (description["image_key"], description["video_key"]) == ("image", None)  # reopens as an image column
    # `video` wins over `media_path` and `image` when the file has several; an explicit column wins over all.
    both = [{"video": "clips/a.mp4", "media_path": "clips/b.webm", "image": "pics/p.png", "text": "t",
             "caption": "c"}]
    (folder / "both.json").write_text(json.dumps(both))
    assert list(metadata(folder / "both.json").list_ids()) == ["clips/a.mp4"]
    renamed = read_all(metadata(folder / "both.json", video_key="media_path", caption_key="text"))
    assert (renamed["clips/b.webm"].video, renamed["clips/b.webm"].caption) == (WEBM, "t")
    assert list(metadata(folder / "both.json", image_key="image").list_ids()) == ["pics/p.png"]
    (folder / "empty.json").write_text("[]")
    assert list(metadata(folder / "empty.json").list_ids()) == []


def test_metadata_absolute_paths(tmp_path: Path) -> None:
    import json

    folder = write_media(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "abs.json").write_text(json.dumps([{"caption": "abs", "video": str(folder / "clips/a.mp4")}]))
    assert read_all(metadata(elsewhere / "abs.json"))[str(folder / "clips/a.mp4")].video == MP4


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.json", '[{"caption": "a", "video": "a.mp4"},\n {"caption": }]',
     r"bad.json: line 2 column 14: not valid JSON"),
    ("obj.json", '{"caption": "a"}', r"obj.json: expected a JSON list of objects.*got a dict"),
    ("list.json", '[{"caption": "a", "video": "a.mp4"}, "b.mp4"]', r"list.json: element 2 of the list is a str"),
    ("bad.jsonl", '{"caption": "a", "video": "a.mp4"}\n\n{"caption": "b", \n', r"bad.jsonl: line 3 column \d+: not "),
    ("arr.jsonl", '["a.mp4", "a"]\n', r"arr.jsonl: line 1 is a list"),
    ("wide.csv", "video,caption\na.mp4,a\nb.mp4,b,extra\n", r"wide.csv: line 3 has 3 cells, the header 2"),
    ("empty.csv", "", r"empty.csv: the CSV file is empty"),
    ("nocap.csv", "video,text\na.mp4,a\n", r"nocap.csv: no caption column \(looked for \['caption'\]\); the columns "
                                           r"are \['video', 'text'\]; name yours with --caption-column"),
    ("nomedia.jsonl", '{"caption": "a", "path": "a.mp4"}\n',
     r"no media path column \(looked for \['video', 'media_path', 'image'\]\); the columns are \['caption', 'path'\]"),
    ("latin1.csv", "video,caption\na.mp4,caf\xe9\n".encode("latin-1"), r"latin1.csv: line 2: invalid UTF-8"),
    ("data.txt", "", r"must end in one of \['.json', '.jsonl', '.csv'\]"),
])
def test_malformed_metadata_files_are_source_errors(tmp_path: Path, name: str, content: str | bytes,
                                                     message: str) -> None:
    write(tmp_path / name, content)
    with pytest.raises(SourceError, match=message) as info:
        metadata(tmp_path / name)
    assert name in str(info.value)


def test_metadata_unknown_columns_and_missing_file(tmp_path: Path) -> None:
    write(tmp_path / "d.csv", "media_path,caption\na.mp4,a\n")
    with pytest.raises(SourceError, match=r"source.video_key 'clip' is not a column; the columns are "
                                          r"\['media_path', 'caption'\]"):
        metadata(tmp_path / "d.csv", video_key="clip")
    with pytest.raises(SourceError, match=r"d.csv: source.caption_key 'prompt' is not a column"):
        metadata(tmp_path / "d.csv", caption_key="prompt")
    with pytest.raises(SourceError, match=r"nope.json does not exist"):
        metadata(tmp_path / "nope.json")
    with pytest.raises(SourceError, match="metadata_file is not set"):
        open_source(SourceConfig(type="metadata"))


def test_metadata_ids_from_an_earlier_listing(tmp_path: Path) -> None:
    import json

    folder = write_media(tmp_path)
    (folder / "d.json").write_text(json.dumps(ROWS[:2]))
    planned = list(metadata(folder / "d.json").list_ids())
    (folder / "d.json").write_text(json.dumps(ROWS[1:2] + [{"caption": "new", "media_path": "clips/a.mp4"}]))
    got = list(metadata(folder / "d.json").read(planned))
    assert [reason(s) for s in got] == [None, None]  # ids are paths: rows may move
    (folder / "d.json").write_text(json.dumps(ROWS[1:2]))
    got = list(metadata(folder / "d.json").read(planned))
    assert [reason(s) for s in got] == ["source_missing", None]
    assert "no row of" in got[0].reject.detail


@pytest.mark.usefixtures("aws_env")
def test_metadata_file_in_a_bucket(admin, proxy, tmp_path: Path) -> None:
    import json

    folder = write_media(tmp_path / "data")
    (folder / "clips/folder.mp4").rmdir()  # a bucket has no folders
    rows = [r for r in ROWS if r.get("media_path") != "clips/folder.mp4"]
    (folder / "dataset.json").write_text(json.dumps(rows))
    prefix = unique_prefix()
    upload(admin, tmp_path / "data", prefix)
    local = read_all(metadata(folder / "dataset.json"))
    url = f"s3://{BUCKET}/{prefix}meta/dataset.json"
    source = metadata(url, s3_endpoint_url=proxy.url)
    remote = read_all(source)
    assert list(remote) == list(local) == IDS[:-1]
    assert {i: outcome(s) for i, s in remote.items()} == {i: outcome(s) for i, s in local.items()}
    assert f"s3://{BUCKET}/{prefix}meta/clips/missing.mp4" in remote["clips/missing.mp4"].reject.detail
    assert source.describe()["metadata_file"] == url and source.describe()["s3_endpoint_url"] == proxy.url

    # s3:// paths are taken as they are; a relative path cannot leave the bucket.
    (folder / "urls.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"caption": "by url", "video": f"s3://{BUCKET}/{prefix}meta/clips/b.webm"},
        {"caption": "escapes", "video": "../../../x.mp4"},
        {"caption": "bad url", "video": "s3://"},
    ]))
    admin.put_object(Bucket=BUCKET, Key=prefix + "meta/urls.jsonl", Body=(folder / "urls.jsonl").read_bytes())
    urls = list(metadata(f"s3://{BUCKET}/{prefix}meta/urls.jsonl", s3_endpoint_url=proxy.url).read(
        [f"s3://{BUCKET}/{prefix}meta/clips/b.webm", "../../../x.mp4", "s3://"]))
    assert urls[0].video == WEBM and urls[0].caption == "by url"
    assert [reason(s) for s in urls[1:]] == ["invalid_media_path", "invalid_media_path"]
    assert "leads out of the bucket" in urls[1].reject.detail
    with pytest.raises(SourceError, match=rf"s3://{BUCKET}/{prefix}none.json does not exist"):
        metadata(f"s3://{BUCKET}/{prefix}none.json", s3_endpoint_url=proxy.url)


def test_metadata_flags_reach_the_settings() -> None:
    from diffprep.cli import build_parser, overrides_from
    from diffprep.config import Settings

    for command in ("encode", "raw"):
        args = build_parser().parse_args([command, "--source-type", "metadata", "--metadata-file", "s3://b/d.csv",
                                          "--caption-column", "text", "--video-column", "clip"])
        assert overrides_from(args) == {"source": {"type": "metadata", "metadata_file": "s3://b/d.csv",
                                                   "caption_key": "text", "video_key": "clip"}}
    assert Settings(source=overrides_from(args)["source"]).source.video_key == "clip"
    assert overrides_from(build_parser().parse_args(["encode", "--video-key", "webm"])) == {
        "source": {"video_key": "webm"}}


# --- webdataset: clip members -----------------------------------------------------------------------


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


JPG = image_bytes(1, "JPEG")
MOV, MKV = clip("mov", 20), clip("mkv", 30)


def write_clip_shards(folder: Path) -> Path:
    make_tar(folder / "clips-000.tar", [
        ("a.mp4", MP4), ("a.txt", b" clip a \n"),
        ("b.WEBM", WEBM), ("b.json", b'{"prompt": "from json"}'),
        ("thumb.jpg", JPG), ("thumb.mp4", MP4), ("thumb.txt", b"clip with a thumbnail"),
        ("d/c.mov", MOV), ("d/c.txt", b"nested mov"),
        ("e.mkv", MKV), ("e.caption", b"mkv"),
        ("pic.jpg", JPG), ("pic.txt", b"still an image"),
        ("nocap.mp4", MP4), ("bad.webm", WEBM), ("bad.txt", b"ok\xc3("), ("nomedia.txt", b"text only"),
        ("dup.mp4", MP4), ("dup.MP4", MP4), ("dup.txt", b"d"),
        ("x.001.mp4", MP4), ("x.001.txt", b"dotted"),
    ])
    make_tar(folder / "clips-001.tar", [("a.mp4", clip("mp4", 200)), ("a.txt", b"second shard")])
    return folder


def wds(pattern: str, **fields) -> Source:
    return open_source(SourceConfig(type="webdataset", input_path=pattern, **fields))


def test_webdataset_clip_members(tmp_path: Path) -> None:
    folder = write_clip_shards(tmp_path / "shards")
    source = wds(str(folder / "*.tar"))
    samples = read_all(source)
    s0 = "clips-000.tar/"
    assert [(s.video, s.image, s.caption) for s in (samples[s0 + "a"], samples[s0 + "b"], samples[s0 + "e"])] == [
        (MP4, None, "clip a"), (WEBM, None, "from json"), (MKV, None, "mkv")]
    assert (samples[s0 + "d/c"].video, samples[s0 + "d/c"].caption) == (MOV, "nested mov")
    assert (samples[s0 + "thumb"].video, samples[s0 + "thumb"].image) == (MP4, None)  # the clip, not its thumbnail
    assert (samples[s0 + "pic"].image, samples[s0 + "pic"].video) == (JPG, None)  # image samples are unchanged
    assert samples["clips-001.tar/a"].caption == "second shard"
    assert {k[len(s0):]: reason(s) for k, s in samples.items() if reason(s)} == {
        "nocap": "missing_caption", "bad": "caption_decode_error", "nomedia": "missing_image",
        "dup": "duplicate_member", "x": "missing_image",
    }
    assert samples[s0 + "nocap"].video == MP4 and samples[s0 + "bad"].video == WEBM  # kept for the report
    assert "no image or clip member; members are ['txt']" in samples[s0 + "nomedia"].reject.detail
    assert source.describe()["video_key"] is None

    # Named members: only those are looked at, the clip's first.
    dotted = read_all(wds(str(folder / "clips-000.tar"), video_key="001.MP4", caption_key="001.txt"))
    assert (dotted[s0 + "x"].video, dotted[s0 + "x"].caption) == (MP4, "dotted")
    assert "no '001.mp4' member" in dotted[s0 + "a"].reject.detail
    thumbs = read_all(wds(str(folder / "clips-000.tar"), image_key="jpg"))
    assert (thumbs[s0 + "thumb"].image, thumbs[s0 + "thumb"].video) == (JPG, None)
    assert reason(thumbs[s0 + "a"]) == "missing_image"
    both = read_all(wds(str(folder / "clips-000.tar"), video_key="mp4", image_key="jpg"))
    assert (both[s0 + "thumb"].video, both[s0 + "pic"].image, reason(both[s0 + "b"])) == (MP4, JPG, "missing_image")
    assert wds(str(folder / "clips-000.tar"), video_key="MP4").describe()["video_key"] == "mp4"


@pytest.mark.usefixtures("aws_env")
def test_webdataset_clips_from_a_bucket_equal_local(admin, proxy, tmp_path: Path) -> None:
    folder = write_clip_shards(tmp_path / "shards")
    prefix = unique_prefix()
    upload(admin, folder, prefix)
    local = read_all(wds(str(folder / "*.tar")))
    remote = read_all(wds(f"s3://{BUCKET}/{prefix}*.tar", s3_endpoint_url=proxy.url))
    assert list(remote) == list(local)
    assert {i: outcome(s) for i, s in remote.items()} == {i: outcome(s) for i, s in local.items()}
    assert remote["clips-000.tar/thumb"].video == MP4


# --- huggingface: a Video column --------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def hf_video_dataset(tmp_path: Path):
    """Rows of clips (bytes, a local path, none) with a thumbnail Image column beside them."""
    import datasets

    write(tmp_path / "files/b.webm", WEBM)
    features = datasets.Features({"video": datasets.Video(), "thumb": datasets.Image(),
                                  "text": datasets.Value("string")})
    rows = {
        "video": [{"bytes": MP4, "path": None}, str(tmp_path / "files/b.webm"), None, {"bytes": MKV, "path": None}],
        "thumb": [Image.new("RGB", (8, 8), (i * 50, 0, 0)) for i in range(4)],
        "text": [" clip a ", "clip b", "no clip", None],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def hf(dataset: str, **fields) -> Source:
    return open_source(SourceConfig(type="huggingface", hf_dataset=dataset, **fields))


def check_hf_clips(samples: dict[str, SourceSample]) -> None:
    assert [(s.video, s.image, s.caption, reason(s)) for s in samples.values()] == [
        (MP4, None, "clip a", None), (WEBM, None, "clip b", None), (None, None, None, "missing_video"),
        (MKV, None, None, "missing_caption")]


@pytest.mark.usefixtures("hf_cache")
def test_hf_video_column_is_read_undecoded(tmp_path: Path) -> None:
    hf_video_dataset(tmp_path).save_to_disk(str(tmp_path / "saved"))
    source = hf(str(tmp_path / "saved"))
    # The Video feature is read as {bytes, path}: no video decoder (torchcodec) is needed, or made.
    assert (source.video_key, source.image_key, source.caption_key) == ("video", None, "text")
    samples = read_all(source)
    check_hf_clips(samples)
    assert "no video in 'video'" in samples["train/2"].reject.detail
    assert source.describe()["video_key"] == "video" and source.describe()["image_key"] is None
    # The image column is read instead when named.
    thumbs = read_all(hf(str(tmp_path / "saved"), image_key="thumb"))
    assert thumbs["train/2"].image is not None and thumbs["train/2"].video is None
    assert Image.open(io.BytesIO(thumbs["train/1"].image)).getpixel((0, 0)) == (50, 0, 0)


@pytest.mark.usefixtures("hf_cache")
@pytest.mark.parametrize("streaming", [False, True])
def test_hf_video_parquet_mapped_and_streaming(tmp_path: Path, streaming: bool) -> None:
    hf_video_dataset(tmp_path).to_parquet(str(tmp_path / "rows.parquet"))
    source = hf("parquet", hf_data_files=str(tmp_path / "rows.parquet"), hf_streaming=streaming)
    assert source.describe()["streaming"] is streaming and source.video_key == "video"
    check_hf_clips(read_all(source))
    assert [s.video for s in source.read(["train/3", "train/0"])] == [MKV, MP4]


@pytest.mark.usefixtures("hf_cache")
def test_hf_video_columns_by_name_and_path(tmp_path: Path) -> None:
    import datasets

    write(tmp_path / "c.mov", MOV)
    plain = tmp_path / "plain"
    datasets.Dataset.from_dict({"mp4": [str(tmp_path / "c.mov"), str(tmp_path / "gone.mp4"), None],
                                "clip": [MP4, None, b""], "n": [1, 2, 3],
                                "caption": ["c", "gone", "none"]}).save_to_disk(str(plain))
    samples = read_all(hf(str(plain)))  # a column named mp4 holding paths
    assert [(s.video, reason(s)) for s in samples.values()] == [
        (MOV, None), (None, "missing_video"), (None, "missing_video")]
    assert "video path" in samples["train/1"].reject.detail and "is not a file" in samples["train/1"].reject.detail
    by_bytes = read_all(hf(str(plain), video_key="clip"))  # a named column of bytes
    assert [(s.video, s.caption) for s in by_bytes.values()][0] == (MP4, "c")
    numbers = read_all(hf(str(plain), video_key="n"))
    assert reason(numbers["train/0"]) == "unsupported_video_value"
    assert "datasets.Video feature" in numbers["train/0"].reject.detail
    with pytest.raises(SourceError, match=r"source.video_key 'movie' matches no column"):
        hf(str(plain), video_key="movie")


@pytest.mark.usefixtures("hf_cache")
def test_hf_videofolder_reads_clip_files_by_path(tmp_path: Path) -> None:
    import json

    root = tmp_path / "videofolder"
    write(root / "0.mp4", MP4)
    write(root / "1.mov", MOV)  # (datasets takes .webm files for audio)
    write(root / "metadata.jsonl", "".join(json.dumps({"file_name": name, "text": f"t{i}"}) + "\n"
                                           for i, name in enumerate(["0.mp4", "1.mov"])))
    samples = read_all(hf(str(root)))
    assert sorted((s.caption, s.video) for s in samples.values()) == [("t0", MP4), ("t1", MOV)]
