"""The raw pipeline: prepared images and captions as files, through the library, the CLI and the encode-raw flow."""

from __future__ import annotations

import hashlib
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# Prefect's console log handler keeps the stream it finds when prefect is first imported: import it
# here, at collection, so it holds pytest's session stream rather than one test's capture buffer.
import diffprep.flows.encode  # noqa: F401

from diffprep import contract
from diffprep.cli import main
from diffprep.config import load_settings
from diffprep.validation.decode import decode_dataset
from diffprep.report.pictures import CONTACT_SHEET, file_pixels
from diffprep.tools.demo import write_demo_dataset
from diffprep.run.units import encode_unit
from diffprep.run.energon import read_dataset_encoding
from diffprep.errors import ConfigError
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.writer.plan import write_plan
from diffprep.encodings.raw import BATCH_SIZE, RawImageWriter, image_bytes, raw_fields
from diffprep.writer.shards import read_manifests
from diffprep.tasks.common import slug
from diffprep.validation import validate_dataset


def pixels(seed: int = 0, size: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def shard_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def raw_settings(data: Path, out: Path, **raw):
    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 4},
        "image": {"image_size": 32, "decode_workers": 1},
        "raw": raw,
    })


# --- image files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["jpg", "png", "webp"])
def test_image_bytes_are_deterministic_and_carry_no_metadata(image_format: str) -> None:
    first = image_bytes(pixels(), image_format, 90)
    assert first == image_bytes(pixels(), image_format, 90)
    with Image.open(io.BytesIO(first)) as image:
        assert image.format == {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[image_format]
        assert image.mode == "RGB" and image.size == (32, 32)
        assert not {"exif", "icc_profile", "xmp"} & set(image.info)
    if image_format == "png":
        assert torch.equal(file_pixels(first), pixels())  # lossless
        assert image_bytes(pixels(), "png", 10) == first  # quality does not apply
    else:
        assert image_bytes(pixels(), image_format, 50) != first


def test_bad_format_and_quality_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"raw.image_format must be one of \['jpg', 'png', 'webp'\], got 'gif'"):
        RawImageWriter("gif", 90)
    with pytest.raises(ConfigError, match="raw.image_quality must be in 1..100, got 0"):
        image_bytes(pixels(), "jpg", 0)
    with pytest.raises(ConfigError, match="image_quality"):
        load_settings(overrides={"raw": {"image_quality": 101}})


def test_raw_plan_needs_no_encoders_and_fingerprints_format_and_quality(tmp_path: Path) -> None:
    data = write_demo_dataset(tmp_path / "data", samples=5)
    # No model_path given: the default hub model is never resolved for a raw plan (the tests run offline).
    plan, _ = fetch(raw_settings(data, tmp_path / "out"), encoding=contract.ENCODING_RAW)
    assert plan.encoding == "raw" and "encoders" not in plan.settings
    assert plan.expected == {"fields": ["jpg", "meta.json", "txt"]} == {"fields": raw_fields("jpg")}
    assert [len(u.source_ids) for u in plan.units] == [4, 1]

    def fp(**raw) -> str:
        return fetch(raw_settings(data, tmp_path / "out", **raw), encoding=contract.ENCODING_RAW)[0].fingerprint

    assert fp(image_format="jpg", image_quality=95) == plan.fingerprint
    assert len({plan.fingerprint, fp(image_quality=80), fp(image_format="webp")}) == 3
    assert fp(image_format="png", image_quality=10) == fp(image_format="png", image_quality=90)


def test_alpha_and_palette_images_are_converted_not_dropped(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "captions").mkdir()
    rgba = Image.new("RGBA", (40, 40), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (10, 10, 30, 30))
    rgba.save(data / "images" / "rgba.png")
    palette = Image.new("P", (40, 40), 0)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.paste(1, (10, 10, 30, 30))
    palette.save(data / "images" / "palette.png", transparency=0)
    Image.new("LA", (40, 40), (128, 255)).save(data / "images" / "grey-alpha.png")
    Image.new("CMYK", (40, 40), (0, 255, 255, 0)).save(data / "images" / "cmyk.jpg")
    for name in ("rgba", "palette", "grey-alpha", "cmyk"):
        (data / "captions" / f"{name}.txt").write_text(f"a {name} image")
    out = tmp_path / "out"
    settings = raw_settings(data, out, image_format="png")
    plan, source = fetch(settings, encoding=contract.ENCODING_RAW)
    write_plan(out, plan)
    writer = RawImageWriter("png", 95)
    result = encode_unit(out, plan, 0, writer.sample_fields, source, ImageSpec.from_config(settings.image),
                         batch_size=BATCH_SIZE)
    assert (result.count, result.rejected) == (4, 0)

    members = shard_members(out / "000000.tar")
    manifest = read_manifests(out)[0]
    by_source = dict(zip(manifest.source_ids, manifest.keys))
    assert sorted(by_source) == ["cmyk.jpg", "grey-alpha.png", "palette.png", "rgba.png"]
    for source_id, key in by_source.items():
        assert sorted(name.partition(".")[2] for name in members if name.startswith(key)) == raw_fields("png")
        meta = json.loads(members[f"{key}.meta.json"])
        with Image.open(io.BytesIO(members[f"{key}.png"])) as image:
            assert image.mode == "RGB" and image.size == (32, 32)
        stored = file_pixels(members[f"{key}.png"])
        assert torch.equal(stored, prepare_image((data / "images" / source_id).read_bytes(),
                                                 ImageSpec.from_config(settings.image)).pixels)
        if source_id in ("rgba.png", "palette.png", "grey-alpha.png"):
            assert "alpha_composited" in meta["notes"]
            if source_id != "grey-alpha.png":
                assert stored[:, 0, 0].tolist() == [255, 255, 255]  # a transparent corner, on the white background
        assert members[f"{key}.txt"].decode() == f"a {source_id.rsplit('.', 1)[0]} image"
    assert "mode:P->RGB" in json.loads(members[f"{by_source['palette.png']}.meta.json"])["notes"]
    assert "mode:CMYK->RGB" in json.loads(members[f"{by_source['cmyk.jpg']}.meta.json"])["notes"]

    # A png dataset holds the prepared pixels exactly: decoding it back is identical to its sources.
    report = decode_dataset(out, 4)
    assert report.encoding == "raw" and all(math.isinf(p.psnr_db) for p in report.previews)
    assert {s["note"] for s in report.to_json()["samples"]} == {"identical to the source"}


# --- the CLI and the encode-raw flow ---------------------------------------------------------------


def _raw_args(config: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["raw", "--config", str(config), "--input-dir", str(data), "--output-dir", str(out), *extra]


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


@pytest.mark.slow
def test_raw_cli_end_to_end_is_reproducible_and_validates(prefect_server, tmp_path: Path, capsys) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    data = write_demo_dataset(tmp_path / "data", samples=10)
    Image.new("RGBA", (50, 40), (0, 200, 0, 128)).save(data / "images" / "00003a-alpha.png")
    (data / "captions" / "00003a-alpha.txt").write_text("half transparent green")
    config = tmp_path / "raw.yaml"
    config.write_text("source:\n  type: directory\noutput:\n  shard_size: 4\nimage:\n  image_size: 32\n"
                      "raw:\n  image_format: webp\n  image_quality: 80\nfinalize:\n  train_split: 0.5\n")
    first, second = tmp_path / "raw-a", tmp_path / "raw-b"

    assert main(_raw_args(config, data, first, "--image-quality", "70")) == 0
    printed = capsys.readouterr().out
    assert "samples written: 11   rejected: 0" in printed and "validation: passed" in printed
    assert "images WEBP RGB: " in printed and f"contact sheet {first / contract.STATE_DIR / CONTACT_SHEET}" in printed

    assert read_dataset_encoding(first) == contract.ENCODING_RAW
    plan = json.loads((first / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["settings"]["raw"] == {"image_format": "webp", "image_quality": 70}  # the flag beat the file
    members = shard_members(first / "000000.tar")
    assert sorted(members) == [f"000000_00000{i}.{f}" for i in range(4) for f in ("meta.json", "txt", "webp")]
    assert members["000000_000000.txt"].decode().startswith("a ")

    sanity = json.loads((first / contract.STATE_DIR / contract.SANITY_DIR / "report.json").read_text())
    assert sanity["ok"] and sanity["shapes"] == {"webp": [3, 32, 32]} and len(sanity["psnr_db"]) == 4  # unit 0
    assert all(math.isfinite(v) for v in sanity["psnr_db"]) and Path(sanity["contact_sheet"]).is_file()
    validation = json.loads((first / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert validation["ok"] and validation["summary"]["loaded"]["samples"] == len(list(first.glob("*.tar")))
    # Counted over the loaded samples: --full loads every one (the run's own validation one per shard).
    assert validate_dataset(first, previews=0, full=True).summary["images"] == {"WEBP RGB": 11}
    assert sum(v["samples"] for v in validation["summary"]["splits"].values()) == 11
    assert [p["psnr_db"] > 15 for p in validation["summary"]["previews"]["samples"]] == [True] * 4

    with get_client(sync_client=True) as client:
        keys = [f"validation-{slug(str(first))}", f"sanity-{slug(str(first))}"]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    assert sorted(a.key for a in artifacts) == sorted(keys)
    assert all("![contact sheet](data:image/png;base64," in a.data for a in artifacts)

    # Same settings, another output: the same bytes. The same output again: nothing to write, nothing touched.
    assert main(_raw_args(config, data, second, "--image-quality", "70", "--no-finalize")) == 0
    assert _hashes(first) == _hashes(second) and len(_hashes(first)) == 3
    before = {p.name: p.stat().st_mtime_ns for p in first.glob("*.tar")}
    capsys.readouterr()
    assert main(_raw_args(config, data, first, "--image-quality", "70")) == 0
    assert "complete" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in first.glob("*.tar")} == before

    assert main(["validate", str(first), "--encoding", "raw"]) == 0
    assert main(["validate", str(first), "--encoding", "preencoded"]) == 1

    # Other settings over an existing raw output: asked, and refused without an answer ahead of time.
    capsys.readouterr()
    assert main(_raw_args(config, data, first, "--image-format", "png", "--on-existing", "abort")) == 2
    assert "aborted" in capsys.readouterr().err
    assert _hashes(first) == _hashes(second)


def test_raw_cli_refuses_encoder_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["raw", "--model-path", "x"])
    assert "unrecognized arguments: --model-path" in capsys.readouterr().err


def test_stored_webp_decodes_close_to_its_source() -> None:
    original = np.zeros((32, 32, 3), dtype=np.uint8)
    original[8:24, 8:24] = (200, 40, 40)
    prepared = torch.from_numpy(original.transpose(2, 0, 1).copy())
    stored = file_pixels(image_bytes(prepared, "webp", 95))
    assert stored.shape == prepared.shape
    assert float((stored.float() - prepared.float()).abs().mean()) < 4
