"""Sources in S3-compatible storage, against a real S3 endpoint on loopback (moto's server, over HTTP).

Every request of the code under test goes through the fault-injecting proxy
of tests/s3_store.py. Each bucket-backed source is compared with the local
source reading the same files.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path

import pytest
from PIL import Image

from diffprep.phases.audit import audit
from diffprep.config import ModelConfig, SourceConfig
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.units import encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.errors import SourceError
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.writer.plan import write_plan
from diffprep.writer.shards import read_manifests
from diffprep.sources import Source, SourceSample, open_source
from s3_store import ACCESS_KEY, SECRET_KEY, FaultProxy
from diffprep.sources.storage import (
    S3Url,
    StorageUnavailableError,
    glob_match,
    parse_s3_url,
    read_object,
    s3_client,
)

BUCKET = "diffprep-src"  # created by the admin fixture (conftest.py)

pytestmark = pytest.mark.usefixtures("aws_env")


def upload(admin, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            admin.put_object(Bucket=BUCKET, Key=prefix + path.relative_to(local).as_posix(), Body=path.read_bytes())


def unique_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}/"


# --- data ------------------------------------------------------------------------------------------


def image_bytes(color: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (color, 255 - color, 0)).save(buf, format=fmt)
    return buf.getvalue()


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


JPG, PNG = image_bytes(1, "JPEG"), image_bytes(2)


def write_shards(folder: Path) -> Path:
    """Two shards with good samples and the webdataset reject cases; returns the folder."""
    make_tar(folder / "shard-000.tar", [
        ("__meta__", b"skipped"), ("a.jpg", JPG), ("a.txt", b" first \n"),
        ("b.PNG", PNG), ("b.json", json.dumps({"prompt": "from json"}).encode()),
        ("dir/c.webp", image_bytes(3, "WEBP")), ("dir/c.caption", b"nested"),
        ("../evil.jpg", JPG), ("../evil.txt", b"x"), ("noimg.txt", b"text"), ("nocap.jpg", JPG),
        ("bad.jpg", JPG), ("bad.txt", b"ok\xc3("), ("dup.jpg", JPG), ("dup.txt", b"d"), ("dup.JPG", JPG),
        ("e.png", image_bytes(4)), ("e.txt", b"late json does not matter"),
    ])
    make_tar(folder / "shard-001.tar", [("a.jpg", PNG), ("a.txt", b"second shard"),
                                        ("f.jpg", image_bytes(5, "JPEG")), ("f.txt", b"f")])
    make_tar(folder / "sub" / "shard-009.tar", [("z.jpg", JPG), ("z.txt", b"under sub/: not matched by *")])
    (folder / "notes.txt").write_text("not a shard")
    return folder


def read_all(source: Source) -> dict[str, SourceSample]:
    ids = list(source.list_ids())
    samples = list(source.read(ids))
    assert [s.source_id for s in samples] == ids
    assert len(set(ids)) == len(ids)
    return {s.source_id: s for s in samples}


def outcome(sample: SourceSample) -> tuple:
    """What a sample is, wherever it was read from (reject details name the location, so only the reason)."""
    return sample.image, sample.caption, sample.reject.reason if sample.reject else None


def config(proxy: FaultProxy, **fields) -> SourceConfig:
    return SourceConfig(s3_endpoint_url=proxy.url, **fields)


def no_secrets(text: str) -> None:
    assert SECRET_KEY not in text and ACCESS_KEY not in text


# --- webdataset ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(admin, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The shards on disk, and the same files uploaded under ``s3://BUCKET/wds/``."""
    folder = write_shards(tmp_path_factory.mktemp("wds") / "shards")
    upload(admin, folder, "wds/")
    return folder, f"s3://{BUCKET}/wds/"


def test_webdataset_from_bucket_equals_local(shards, proxy: FaultProxy) -> None:
    folder, url = shards
    local = read_all(open_source(SourceConfig(type="webdataset", input_path=str(folder / "*.tar"))))
    source = open_source(config(proxy, type="webdataset", input_path=url + "*.tar"))
    remote = read_all(source)

    assert list(remote) == list(local)  # same ids, same order
    assert list(remote)[:3] == ["shard-000.tar/a", "shard-000.tar/b", "shard-000.tar/dir/c"]
    assert {i: outcome(s) for i, s in remote.items()} == {i: outcome(s) for i, s in local.items()}
    assert outcome(remote["shard-001.tar/a"]) == (PNG, "second shard", None)
    assert {i: s.reject.reason for i, s in remote.items() if s.reject} == {
        "shard-000.tar/../evil": "unsafe_member_path", "shard-000.tar/noimg": "missing_image",
        "shard-000.tar/nocap": "missing_caption", "shard-000.tar/bad": "caption_decode_error",
        "shard-000.tar/dup": "duplicate_member",
    }
    assert f"s3://{BUCKET}/wds/shard-000.tar:bad" in remote["shard-000.tar/bad"].reject.detail
    description = source.describe()
    assert description == {
        "type": "webdataset", "input_path": url + "*.tar", "base": url, "num_shards": 2, "image_key": None,
        "video_key": None, "caption_key": None, "s3_endpoint_url": proxy.url, "s3_profile": None,
    }
    no_secrets(json.dumps(description))
    # Listing streamed each shard once, and so did reading every id.
    for name in ("shard-000.tar", "shard-001.tar"):
        assert len(proxy.requests("GET", f"/{BUCKET}/wds/{name}")) == 2

    braces = open_source(config(proxy, type="webdataset", input_path=url + "shard-{000..001}.tar"))
    assert braces.shards == source.shards
    recursive = open_source(config(proxy, type="webdataset", input_path=url + "**/*.tar"))
    assert recursive.shards == ["shard-000.tar", "shard-001.tar", "sub/shard-009.tar"]
    with pytest.raises(SourceError, match=r"matches no object \(listed s3://diffprep-src/wds/"):
        open_source(config(proxy, type="webdataset", input_path=url + "*.tar.gz"))


def test_webdataset_read_streams_each_needed_shard_once(shards, proxy: FaultProxy) -> None:
    _, url = shards
    source = open_source(config(proxy, type="webdataset", input_path=url + "shard-*.tar"))
    proxy.reset()
    wanted = ["shard-001.tar/a", "shard-000.tar/dir/c", "shard-000.tar/a", "shard-001.tar/f"]
    assert [(s.source_id, s.caption) for s in source.read(wanted)] == [
        ("shard-001.tar/a", "second shard"), ("shard-000.tar/dir/c", "nested"), ("shard-000.tar/a", "first"),
        ("shard-001.tar/f", "f")]
    gets = [r.path for r in proxy.log if r.method == "GET"]
    assert gets == [f"/{BUCKET}/wds/shard-001.tar", f"/{BUCKET}/wds/shard-000.tar"]


def test_webdataset_vanished_shard_reads_as_missing(shards, admin, proxy: FaultProxy) -> None:
    folder, _ = shards
    prefix = unique_prefix()
    upload(admin, folder, prefix)
    source = open_source(config(proxy, type="webdataset", input_path=f"s3://{BUCKET}/{prefix}*.tar"))
    admin.delete_object(Bucket=BUCKET, Key=prefix + "shard-001.tar")
    got = list(source.read(["shard-001.tar/a", "shard-000.tar/a", "gone.tar/x"]))
    assert [s.reject.reason if s.reject else s.caption for s in got] == ["source_missing", "first", "source_missing"]
    assert "no longer exists" in got[0].reject.detail


# --- directory layout ------------------------------------------------------------------------------


def write_folder(root: Path) -> Path:
    files = {
        "images/a.jpg": image_bytes(1, "JPEG"), "images/a.png": image_bytes(2), "images/B.JPG": image_bytes(3, "JPEG"),
        "images/c.Png": image_bytes(4), "images/sub/deep/e.jpeg": image_bytes(6, "JPEG"),
        "images/orphan.jpg": image_bytes(7), "images/bad.png": image_bytes(8), "images/empty.png": image_bytes(9),
        "images/x.jpg": image_bytes(10), "images/x.k.jpg": image_bytes(11), "images/y.jpg": image_bytes(12),
        "images/notes.md": b"not an image", "images/up.jpg": image_bytes(13), "captions/up.TXT": b"upper",
        "captions/x.TXT": b"second spelling of x.txt",
        "captions/a.txt": b"an a", "captions/B.txt": b"a b", "captions/c.txt": b"a c",
        "captions/sub/deep/e.txt": b"nested e", "captions/bad.txt": b"ok\xff\xfe", "captions/empty.txt": b"",
        "captions/lonely.txt": b"no image", "captions/sub/lonely2.txt": b"none",
        # Stems that are another stem plus a dot: the key order of x.k.txt and x.txt differs from x.jpg's.
        "captions/x.txt": b"plain x", "captions/x.k.txt": b"dotted x", "captions/y.jpg.txt": b"no y.jpg.* image",
        "captions/y.txt": b"\xef\xbb\xbf y with bom \n",
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_directory_under_prefix_equals_local(admin, proxy: FaultProxy, tmp_path: Path) -> None:
    root = write_folder(tmp_path / "data")
    prefix = unique_prefix() + "data"
    upload(admin, root, prefix + "/")
    local = read_all(open_source(SourceConfig(type="directory", input_dir=str(root))))
    source = open_source(config(proxy, type="directory", input_dir=f"s3://{BUCKET}/{prefix}/"))
    remote = read_all(source)

    assert list(remote) == list(local)
    assert {i: outcome(s) for i, s in remote.items()} == {i: outcome(s) for i, s in local.items()}
    assert {i: s.reject.reason for i, s in remote.items() if s.reject} == {
        "orphan.jpg": "missing_caption", "bad.png": "caption_decode_error", "caption-only:lonely.txt":
        "missing_image", "caption-only:sub/lonely2.txt": "missing_image", "caption-only:y.jpg.txt": "missing_image",
        "other:images/notes.md": "unsupported_format", "other:captions/x.TXT": "duplicate_caption",
    }
    assert remote["up.jpg"].caption == "upper"  # a caption's extension in any letter case
    assert (remote["x.jpg"].caption, remote["x.k.jpg"].caption, remote["y.jpg"].caption) == (
        "plain x", "dotted x", "y with bom")
    assert remote["B.JPG"].image == (root / "images/B.JPG").read_bytes() and remote["empty.png"].caption == ""
    assert source.describe() == {"type": "directory", "input_dir": f"s3://{BUCKET}/{prefix}",
                                 "s3_endpoint_url": proxy.url, "s3_profile": None}
    assert list(source.list_ids()) == list(remote)  # stable

    admin.delete_object(Bucket=BUCKET, Key=f"{prefix}/images/a.png")
    admin.delete_object(Bucket=BUCKET, Key=f"{prefix}/captions/lonely.txt")
    admin.delete_object(Bucket=BUCKET, Key=f"{prefix}/captions/c.txt")
    got = list(source.read(["a.png", "caption-only:lonely.txt", "c.Png", "a.jpg"]))
    assert [s.reject.reason if s.reject else s.caption for s in got] == [
        "source_missing", "source_missing", "missing_caption", "an a"]
    assert f"s3://{BUCKET}/{prefix}/images/a.png no longer exists" in got[0].reject.detail


def test_directory_needs_images_and_captions(admin, proxy: FaultProxy) -> None:
    prefix = unique_prefix()
    admin.put_object(Bucket=BUCKET, Key=prefix + "images/a.jpg", Body=JPG)
    with pytest.raises(SourceError, match=rf"has no object under s3://{BUCKET}/{prefix}captions/"):
        open_source(config(proxy, type="directory", input_dir=f"s3://{BUCKET}/{prefix}"))


# --- failures: missing bucket, refused access, throttling, lost connections ------------------------------


def test_missing_bucket_fails_at_once(proxy: FaultProxy) -> None:
    for fields in ({"type": "webdataset", "input_path": "s3://no-such-bucket/shards/*.tar"},
                   {"type": "directory", "input_dir": "s3://no-such-bucket/data"}):
        proxy.reset()
        with pytest.raises(SourceError, match=r"s3://no-such-bucket: ListObjectsV2 failed: the bucket does not "
                                              r"exist \(NoSuchBucket\)") as info:
            open_source(config(proxy, **fields))
        assert len(proxy.log) == 1  # no retry
        no_secrets(str(info.value))


def test_access_denied_fails_at_once_and_names_the_fix(shards, proxy: FaultProxy) -> None:
    _, url = shards
    proxy.inject("GET", f"/{BUCKET}", ("status", 403, "AccessDenied"))
    with pytest.raises(SourceError, match=rf"s3://{BUCKET}: ListObjectsV2 refused \(AccessDenied\).*AWS_PROFILE"
                                          r".*bucket policy") as info:
        open_source(config(proxy, type="webdataset", input_path=url + "*.tar"))
    assert len(proxy.log) == 1
    no_secrets(str(info.value))

    # Refused while reading: the run stops (a SourceError), the samples are not turned into rejects.
    source = open_source(config(proxy, type="webdataset", input_path=url + "*.tar"))
    proxy.inject("GET", f"/{BUCKET}/wds/shard-001.tar", ("status", 403, "AccessDenied"))
    with pytest.raises(SourceError, match=rf"GetObject refused \(AccessDenied\) for {url}shard-001.tar") as info:
        list(source.read(["shard-001.tar/a"]))
    no_secrets(str(info.value))


def test_throttling_and_5xx_are_retried(shards, proxy: FaultProxy) -> None:
    _, url = shards
    proxy.inject("GET", f"/{BUCKET}", ("status", 503, "SlowDown"))
    proxy.inject("GET", f"/{BUCKET}/wds/shard-001.tar", ("status", 503, "SlowDown"), ("status", 500, "InternalError"))
    source = open_source(config(proxy, type="webdataset", input_path=url + "*.tar"))
    assert [s.caption for s in source.read(["shard-001.tar/a", "shard-001.tar/f"])] == ["second shard", "f"]
    assert [r.status for r in proxy.requests("GET", f"/{BUCKET}")] == [503, 200]
    assert [r.status for r in proxy.requests("GET", f"/{BUCKET}/wds/shard-001.tar")] == [503, 500, 200]


def test_retries_run_out_as_a_transient_error(shards, proxy: FaultProxy) -> None:
    client = s3_client(proxy.url, max_attempts=2)
    proxy.inject("GET", f"/{BUCKET}/wds/notes.txt", *[("status", 503, "SlowDown")] * 2)
    with pytest.raises(StorageUnavailableError, match=r"wds/notes.txt: GetObject failed after 2 attempt\(s\) "
                                                      r"\(SlowDown, HTTP 503\)") as info:
        read_object(client, S3Url(BUCKET, "wds/notes.txt"))
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, SourceError)  # tasks retry it
    assert read_object(client, S3Url(BUCKET, "wds/notes.txt")) == b"not a shard"


def test_a_body_cut_short_resumes_where_it_stopped(shards, admin, proxy: FaultProxy) -> None:
    folder, url = shards
    path = f"/{BUCKET}/wds/shard-000.tar"
    source = open_source(config(proxy, type="webdataset", input_path=url + "shard-000.tar"))
    proxy.reset()
    proxy.inject("GET", path, ("truncate", 3000))
    ids = list(source.list_ids())
    assert ids == list(open_source(SourceConfig(type="webdataset", input_path=str(folder / "shard-000.tar")))
                       .list_ids())
    first, resumed = proxy.requests("GET", path)
    assert "Range" not in first.headers
    etag = admin.head_object(Bucket=BUCKET, Key="wds/shard-000.tar")["ETag"]
    assert (resumed.headers["Range"], resumed.headers["If-Match"], resumed.status) == ("bytes=3000-", etag, 206)


# --- settings and URLs -----------------------------------------------------------------------------------


def test_urls_endpoints_and_profiles_are_checked() -> None:
    assert parse_s3_url("s3://bkt/a/b*.tar") == S3Url("bkt", "a/b*.tar")
    assert str(S3Url("bkt", "data").join("images/x.jpg")) == "s3://bkt/data/images/x.jpg"
    for url, message in (("s3://", "has no bucket name"), ("s3:///x", "has no bucket name"),
                         ("s3://bu*ket/x.tar", "is not a bucket name"), ("/data/x", "is not an s3:// URL")):
        with pytest.raises(SourceError, match=message):
            parse_s3_url(url, "source.input_path")
    with pytest.raises(SourceError, match="holds credentials") as info:
        s3_client("http://user:hunter2@minio:9000")
    assert "hunter2" not in str(info.value)
    with pytest.raises(SourceError, match="is not an http"):
        s3_client("minio:9000")
    with pytest.raises(SourceError, match="source.s3_profile 'nope' is not a profile"):
        s3_client(profile="nope")
    with pytest.raises(SourceError, match="reads local tar files or s3:// URLs"):
        open_source(SourceConfig(type="webdataset", input_path="gs://bucket/*.tar"))


def test_glob_matches_like_a_local_glob() -> None:
    assert glob_match("shards/*.tar", "shards/a.tar")
    assert not glob_match("shards/*.tar", "shards/sub/a.tar")  # * stays within one part
    assert not glob_match("shards/*.tar", "shards/.hidden.tar")
    assert glob_match("shards/**/*.tar", "shards/a.tar") and glob_match("shards/**/*.tar", "shards/x/y/a.tar")
    assert glob_match("s/shard-[0-9].tar", "s/shard-7.tar") and not glob_match("s/*.TAR", "s/a.tar")


# --- end to end: plan, encode and audit from the bucket ----------------------------------------------


def test_fetch_encode_audit_from_bucket(shards, proxy: FaultProxy, tmp_path: Path, tiny_model: Path,
                                        settings_for) -> None:
    _, url = shards
    out = tmp_path / "out"
    settings = settings_for(out, tmp_path, tiny_model, source={
        "type": "webdataset", "input_path": url + "*.tar", "s3_endpoint_url": proxy.url})
    plan, source = fetch(settings)
    assert plan.source["s3_endpoint_url"] == proxy.url and plan.source["base"] == url
    assert [len(u.source_ids) for u in plan.units] == [4, 4, 3]
    write_plan(out, plan)
    encoders = FluxEncoders.load(ModelConfig(model_path=str(tiny_model), precision="fp32", device="cpu",
                                             t5_max_length=settings.model.t5_max_length))
    spec = ImageSpec.from_config(settings.image)
    for unit in plan.units:
        encode_unit(out, plan, unit.unit, preencoded_fields(encoders), source, spec, batch_size=4, decode_workers=1)
    report = audit(out, plan)
    assert report.ok, report.problems
    assert (report.inputs, report.written, report.rejected) == (11, 6, 5)
    assert report.by_reason == {"unsafe_member_path": 1, "missing_image": 1, "missing_caption": 1,
                                "caption_decode_error": 1, "duplicate_member": 1}
    written = [sid for manifest in read_manifests(out).values() for sid in manifest.source_ids]
    assert written == ["shard-000.tar/a", "shard-000.tar/b", "shard-000.tar/dir/c", "shard-000.tar/e",
                       "shard-001.tar/a", "shard-001.tar/f"]
