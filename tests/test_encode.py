"""Encoding units with the real tiny Flux model: shards, manifests, rejects, determinism, sanity, prefetch."""

from __future__ import annotations

import gc
import io
import json
import shutil
import tarfile
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffprep import contract
from diffprep.config import ModelConfig
from diffprep.encodings.preencoded import preencoded_fields, sanity_check
from diffprep.output import Output
from diffprep.run.reader import iter_batches, prefetch
from diffprep.run.units import DiskSpaceError, encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.errors import DiffprepError
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec, target_size
from diffprep.writer.shards import file_sha256, read_manifest, tar_keys

T5_LENGTH = 16  # the same as conftest's settings_for


@pytest.fixture(scope="module")
def encoders(tiny_model: Path) -> FluxEncoders:
    """The tiny model loaded once, as settings_for() configures it (fp32, CPU, VAE sampling seeded by key)."""
    model = ModelConfig(model_path=str(tiny_model), precision="fp32", device="cpu", t5_max_length=T5_LENGTH)
    return FluxEncoders.load(model)


@pytest.fixture
def run(tmp_path: Path, tiny_model: Path, settings_for):
    """``run(input_dir, **sections)`` -> (out_dir, settings, plan, source, spec) planned by the real fetch()."""

    def make(input_dir: Path, out_name: str = "out", **sections):
        out = tmp_path / out_name
        settings = settings_for(out, input_dir, tiny_model, **sections)
        plan, source = fetch(settings)
        return out, settings, plan, source, ImageSpec.from_config(settings.image)

    return make


def encode(out: Path, plan, unit: int, encoders, source, spec, batch_size: int = 4, **kwargs):
    return encode_unit(out, plan, unit, preencoded_fields(encoders), source, spec, batch_size=batch_size, **kwargs)


def read_shard(path: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, _, field = member.name.partition(".")
            samples.setdefault(key, {})[field] = tar.extractfile(member).read()
    return samples


def load_tensor(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)


# One unit, end to end


def test_encode_unit_writes_shard_and_manifest(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    assert [len(u.source_ids) for u in plan.units] == [4, 4, 4]
    assert plan.expected == {"latents": [16, 4, 4], "prompt_embeds": [T5_LENGTH, 32],
                             "pooled_prompt_embeds": [32], "dtype": "float32"}
    progress: list[dict] = []

    result = encode(out, plan, 1, encoders, source, spec, progress=progress.append)

    unit = plan.unit(1)
    keys = [f"000001_{i:06d}" for i in range(4)]
    assert (result.unit, result.count, result.rejected, result.skipped) == (1, 4, 0, False)
    assert progress[-1] == {"unit": 1, "samples": 4, "total": 4}
    manifest = read_manifest(out, 1)
    assert manifest.keys == keys
    assert manifest.source_ids == unit.source_ids == ["00004.png", "00005.png", "00006.jpg", "00007.png"]
    assert (manifest.count, manifest.rejects, manifest.notes) == (4, [], {})
    assert manifest.fingerprint == plan.fingerprint
    assert (manifest.bytes, manifest.sha256) == file_sha256(out / "000001.tar")
    assert not (out / "000000.tar").exists()  # only the unit asked for

    samples = read_shard(out / "000001.tar")
    assert list(samples) == keys
    for key, source_id in zip(keys, unit.source_ids):
        fields = samples[key]
        assert sorted(fields) == sorted(contract.PREENCODED_FIELDS)
        for name in contract.TENSOR_FIELDS:
            tensor = load_tensor(fields[name])
            assert list(tensor.shape) == plan.expected[contract.field_stem(name)]
            assert tensor.dtype == torch.float32
            assert bool(torch.isfinite(tensor).all())
        # Each tensor is saved alone (cloned), not with its batch's storage.
        assert len(fields[contract.PROMPT_EMBEDS]) < 2 * T5_LENGTH * 32 * 4
        caption = (demo_data / "captions" / (Path(source_id).stem + ".txt")).read_text().strip()
        assert fields[contract.CAPTION].decode("utf-8") == caption
        meta = json.loads(fields[contract.META])
        assert meta["source_id"] == source_id
        with Image.open(demo_data / "images" / source_id) as image:
            assert meta["original_size"] == list(image.size)
        assert meta["size"] == [32, 32]


def test_same_unit_gives_identical_bytes(run, demo_data: Path, encoders) -> None:
    out_a, _, plan, source, spec = run(demo_data, "a")
    out_b = out_a.parent / "b"
    out_c = out_a.parent / "c"
    encode(out_a, plan, 0, encoders, source, spec, batch_size=4)
    encode(out_b, plan, 0, encoders, source, spec, batch_size=4, decode_workers=2)
    encode(out_c, plan, 0, encoders, source, spec, batch_size=2)
    sha = {name: file_sha256(out / "000000.tar") for name, out in (("a", out_a), ("b", out_b), ("c", out_c))}
    assert sha["a"] == sha["b"]
    # Batches of 2 and of 4 run the same CPU kernels here: byte-identical.
    assert sha["a"] == sha["c"]
    assert read_manifest(out_a, 0).sha256 == read_manifest(out_c, 0).sha256


def test_batch_of_one_gives_the_same_values(run, demo_data: Path, encoders) -> None:
    # A batch of one can take other CPU conv kernels than larger batches (measured here: latents
    # differ in the last bits, max 1e-6 in fp32); the values must agree, the bytes may not.
    out_a, _, plan, source, spec = run(demo_data, "a")
    out_b = out_a.parent / "b"
    encode(out_a, plan, 0, encoders, source, spec, batch_size=4)
    encode(out_b, plan, 0, encoders, source, spec, batch_size=1)
    a, b = read_shard(out_a / "000000.tar"), read_shard(out_b / "000000.tar")
    assert list(a) == list(b)
    for key in a:
        for name in contract.TENSOR_FIELDS:
            torch.testing.assert_close(load_tensor(a[key][name]), load_tensor(b[key][name]), rtol=1e-4, atol=1e-5)
        assert a[key][contract.META] == b[key][contract.META]


def test_encoding_a_committed_unit_again_touches_nothing(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    first = encode(out, plan, 2, encoders, source, spec)
    shard = out / "000002.tar"
    manifest = out / contract.STATE_DIR / contract.UNITS_DIR / "000002.json"
    stamps = (shard.stat().st_mtime_ns, manifest.stat().st_mtime_ns)
    sha = file_sha256(shard)
    time.sleep(0.01)

    again = encode(out, plan, 2, encoders, source, spec)

    assert again.skipped is True
    assert (again.count, again.rejected) == (first.count, first.rejected) == (4, 0)
    assert (shard.stat().st_mtime_ns, manifest.stat().st_mtime_ns) == stamps
    assert file_sha256(shard) == sha
    committed = Output(out).committed_unit(2, plan.fingerprint)
    assert committed is not None and file_sha256(shard)[1] == committed.sha256


def test_damaged_shard_is_encoded_again(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    encode(out, plan, 0, encoders, source, spec)
    good = file_sha256(out / "000000.tar")
    with open(out / "000000.tar", "ab") as handle:
        handle.write(b"\0" * 512)
    assert Output(out).committed_unit(0, plan.fingerprint) is None

    result = encode(out, plan, 0, encoders, source, spec)

    assert result.skipped is False
    assert file_sha256(out / "000000.tar") == good


class FailingEncoders:
    """The real text encoder, and a VAE that fails (as a CUDA out-of-memory error would)."""

    def __init__(self, encoders: FluxEncoders) -> None:
        self._encoders = encoders

    def encode_images(self, pixels: torch.Tensor, keys) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (simulated)")

    def encode_text(self, captions):
        return self._encoders.encode_text(captions)


def test_failed_encode_leaves_no_shard_and_no_manifest(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    with pytest.raises(RuntimeError, match="out of memory"):
        encode(out, plan, 0, FailingEncoders(encoders), source, spec)
    assert list(out.glob("*.tar")) == []
    assert read_manifest(out, 0) is None
    assert list((out / contract.STATE_DIR / contract.TMP_DIR).iterdir()) == []


def test_failed_encode_stops_its_reader_thread(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data, output={"shard_size": 12})
    # 12 batches of one: the reader is still producing when the first batch fails.
    with pytest.raises(RuntimeError, match="out of memory") as info:
        encode(out, plan, 0, FailingEncoders(encoders), source, spec, batch_size=1)
    deadline = time.monotonic() + 2
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = reader_threads()
    del info  # the traceback keeps encode_unit's frame, and so the generator, alive
    gc.collect()
    assert alive == []


# Rejects and notes


def test_rejects_are_recorded_and_keys_keep_their_index(run, demo_data: Path, encoders) -> None:
    images, captions = demo_data / "images", demo_data / "captions"
    jpeg = (images / "00003.jpg").read_bytes()
    (images / "00003_truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (captions / "00003_truncated.txt").write_text("a truncated file")
    shutil.copy(images / "00005.png", images / "00006_nocaption.png")
    shutil.copy(images / "00007.png", images / "00009_badutf8.png")
    (captions / "00009_badutf8.txt").write_bytes(b"caf\xe9 latin-1, not utf-8")
    out, _, plan, source, spec = run(demo_data, output={"shard_size": 16})
    unit = plan.unit(0)
    assert len(unit.source_ids) == 15
    bad = {"00003_truncated.jpg": 4, "00006_nocaption.png": 8, "00009_badutf8.png": 12}
    assert {sid: unit.source_ids.index(sid) for sid in bad} == bad

    result = encode(out, plan, 0, encoders, source, spec)

    assert (result.count, result.rejected) == (12, 3)
    manifest = read_manifest(out, 0)
    assert [(r.source_id, r.reason, r.phase) for r in manifest.rejects] == [
        ("00003_truncated.jpg", "image_truncated", "decode"),
        ("00006_nocaption.png", "missing_caption", "read"),
        ("00009_badutf8.png", "caption_decode_error", "read"),
    ]
    assert "invalid UTF-8 at byte offset 3" in manifest.rejects[2].detail
    kept = [i for i in range(15) if i not in bad.values()]
    assert manifest.keys == [contract.sample_key(0, i) for i in kept]
    assert manifest.source_ids == [unit.source_ids[i] for i in kept]
    assert list(tar_keys(out / "000000.tar")) == manifest.keys
    samples = read_shard(out / "000000.tar")
    assert json.loads(samples["000000_000005"][contract.META])["source_id"] == "00004.png"


class NaNForKeys:
    """The real encoders, with the latents of some sample keys replaced by NaN (a VAE overflow)."""

    def __init__(self, encoders: FluxEncoders, keys: set[str]) -> None:
        self._encoders = encoders
        self._keys = keys

    def encode_images(self, pixels: torch.Tensor, keys) -> torch.Tensor:
        latents = self._encoders.encode_images(pixels, keys)
        for i, key in enumerate(keys):
            if key in self._keys:
                latents[i] = float("nan")
        return latents

    def encode_text(self, captions):
        return self._encoders.encode_text(captions)


def test_non_finite_latents_are_rejected(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    result = encode(out, plan, 0, NaNForKeys(encoders, {"000000_000002"}), source, spec)
    manifest = read_manifest(out, 0)
    assert (result.count, result.rejected) == (3, 1)
    assert [(r.source_id, r.reason, r.phase) for r in manifest.rejects] == [
        ("00002.png", "non_finite_latents", "encode")
    ]
    assert manifest.keys == ["000000_000000", "000000_000001", "000000_000003"]


def test_empty_and_long_captions_are_kept_and_counted(run, demo_data: Path, encoders) -> None:
    (demo_data / "captions" / "00001.txt").write_text("  \n")
    long_caption = " ".join(["a red cat sitting on a blue chair"] * 4)
    (demo_data / "captions" / "00002.txt").write_text(long_caption)
    out, _, plan, source, spec = run(demo_data)

    result = encode(out, plan, 0, encoders, source, spec)

    assert (result.count, result.rejected) == (4, 0)
    manifest = read_manifest(out, 0)
    assert manifest.notes == {"caption_truncated": 1, "empty_caption": 1}
    samples = read_shard(out / "000000.tar")
    assert samples["000000_000001"][contract.CAPTION] == b""
    assert samples["000000_000002"][contract.CAPTION].decode() == long_caption  # the full text is stored
    assert list(load_tensor(samples["000000_000002"][contract.PROMPT_EMBEDS]).shape) == [T5_LENGTH, 32]


# Variable size


def write_sized_dataset(root: Path, sizes: list[tuple[int, int]]) -> Path:
    (root / "images").mkdir(parents=True)
    (root / "captions").mkdir()
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (40 * i % 256, 100, 200)).save(root / "images" / f"{i:03d}.png")
        (root / "captions" / f"{i:03d}.txt").write_text(f"a blue square {i}")
    return root


def test_variable_size_batches_consecutive_samples_of_one_shape(run, tmp_path: Path, encoders) -> None:
    sizes = [(64, 64), (64, 64), (64, 64), (64, 32), (128, 64), (48, 64)]
    data = write_sized_dataset(tmp_path / "sized", sizes)
    out, _, plan, source, spec = run(data, output={"shard_size": 8}, image={"variable_size": True, "max_size": 64})
    assert plan.expected["latents"] == [16, None, None]

    rejects: list = []
    batches = list(iter_batches(source, plan.unit(0), spec, 2, rejects, workers=1))
    assert [b.keys for b in batches] == [
        ["000000_000000", "000000_000001"], ["000000_000002"], ["000000_000003", "000000_000004"], ["000000_000005"],
    ]
    assert [list(b.pixels.shape) for b in batches] == [[2, 3, 64, 64], [1, 3, 64, 64], [2, 3, 32, 64], [1, 3, 64, 48]]
    assert rejects == []

    result = encode(out, plan, 0, encoders, source, spec, batch_size=2)

    assert (result.count, result.rejected) == (6, 0)
    samples = read_shard(out / "000000.tar")
    for i, (width, height) in enumerate(sizes):
        out_w, out_h = target_size(width, height, spec)
        latents = load_tensor(samples[contract.sample_key(0, i)][contract.LATENTS])
        assert list(latents.shape) == [16, out_h // 8, out_w // 8]
        assert json.loads(samples[contract.sample_key(0, i)][contract.META])["size"] == [out_w, out_h]


# Sanity


def test_sanity_check_writes_its_report_and_one_sample(run, demo_data: Path, encoders) -> None:
    out, _, plan, source, spec = run(demo_data)
    report = sanity_check(out, plan, encoders, source, spec, batch_size=4)

    assert report.ok is True
    assert report.problems == []
    assert report.samples == 4
    assert report.shapes == {"latents.pth": [16, 4, 4], "prompt_embeds.pth": [T5_LENGTH, 32],
                             "pooled_prompt_embeds.pth": [32]}
    assert set(report.dtypes.values()) == {"float32"}
    assert report.finite is True
    assert len(report.psnr_db) == 4
    assert report.projected_bytes == report.bytes_per_sample * 12
    sanity = out / contract.STATE_DIR / contract.SANITY_DIR
    assert json.loads((sanity / "report.json").read_text()) == json.loads(json.dumps(report.to_json()))
    sample = torch.load(sanity / "sample.pth", weights_only=True)
    assert {name: list(t.shape) for name, t in sample.items()} == report.shapes
    assert list(out.glob("*.tar")) == []  # never into the dataset

    left = sanity_check(out, plan, encoders, source, spec, batch_size=4, units_left=[2])
    assert left.projected_bytes == left.bytes_per_sample * 4


def test_sanity_check_stops_when_the_disk_is_too_small(run, demo_data: Path, encoders, monkeypatch) -> None:
    out, _, plan, source, spec = run(demo_data)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("diffprep.run.sanity.shutil.disk_usage", lambda path: usage(10_000, 9_000, 1_000))

    with pytest.raises(DiskSpaceError) as info:
        sanity_check(out, plan, encoders, source, spec, batch_size=4)

    message = str(info.value)
    assert "needed" in message and "free" in message
    assert "12 samples" in message
    report = json.loads((out / contract.STATE_DIR / contract.SANITY_DIR / "report.json").read_text())
    assert report["free_bytes"] == 1_000
    assert report["projected_bytes"] > 1_000
    assert list(out.glob("*.tar")) == []


def test_sanity_check_with_nothing_decodable_names_the_rejects(run, tmp_path: Path, encoders) -> None:
    data = write_sized_dataset(tmp_path / "bad", [(32, 32), (32, 32)])
    for image in (data / "images").iterdir():
        image.write_bytes(b"not an image")
    out, _, plan, source, spec = run(data)
    with pytest.raises(DiffprepError) as info:
        sanity_check(out, plan, encoders, source, spec, batch_size=4)
    assert "no sample of the source could be decoded; rejects: 000.png: image_decode_error" in str(info.value)


# prefetch


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "diffprep-reader" and t.is_alive()]


def test_prefetch_yields_in_order() -> None:
    before = reader_threads()
    assert list(prefetch(iter(range(10)), depth=2)) == list(range(10))
    assert reader_threads() == before


def test_prefetch_hands_a_producer_error_to_the_consumer() -> None:
    def failing():
        yield 1
        yield 2
        raise ValueError("sample source broke")

    before = reader_threads()
    seen = []
    with pytest.raises(ValueError, match="sample source broke"):
        for item in prefetch(failing(), depth=1):
            seen.append(item)
    assert seen == [1, 2]
    assert reader_threads() == before


def test_prefetch_stops_its_producer_when_the_consumer_stops_early() -> None:
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    before = reader_threads()
    batches = prefetch(endless(), depth=2)
    taken = []
    for item in batches:
        taken.append(item)
        if len(taken) == 3:
            break
    started = time.monotonic()
    batches.close()  # what leaving encode_unit does with it
    assert time.monotonic() - started < 5
    assert taken == [0, 1, 2]
    assert reader_threads() == before
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count  # nothing is produced after the stop
    assert count <= 3 + 2 + 2  # taken + queue depth + the one in hand
