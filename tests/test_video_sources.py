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
    assert ids == sorted(ids, key=str.encode)  # one bytewise-sorted listing over both folders
    samples = read_all(source)
    assert list(samples) == [
        "B.WEBM", "a.jpg", "a.mp4", "bad.mp4", "caption-only:lonely.txt", "caption-only:sub/lonely2.txt", "d.mkv",
        "e.png", "orphan.mp4", "sub/deep/c.Mov", "sub/f.png",
    ]
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
