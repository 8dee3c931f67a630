"""Aspect-ratio buckets for images (``--buckets``): the bucket lists, the choice and crop, one bucket per unit,
validation per bucket, training batches of one size, and appends that keep every old sample in its bucket."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffprep import contract
from diffprep.errors import ConfigError
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.media.buckets import auto_image_buckets, parse_image_buckets
from diffprep.phases.pipeline import run
from diffprep.writer.shards import load_tensor
from diffprep.validation import validate_dataset
from flow_runs import shard_samples
from latent_direct import close32, direct


def test_auto_buckets_cover_1_to_4_through_4_to_1_at_one_area():
    buckets = auto_image_buckets(1024)
    assert len(buckets) == 41 and len(set(buckets)) == 41
    assert all(b.width % 16 == 0 and b.height % 16 == 0 and b.frames == 1 for b in buckets)
    assert all(abs(b.width * b.height / 1024**2 - 1) < 0.04 for b in buckets)
    assert ((buckets[0].width, buckets[0].height) == (512, 2048)
            and (buckets[-1].width, buckets[-1].height) == (2048, 512))
    assert [b.aspect for b in buckets] == sorted(b.aspect for b in buckets)
    assert any((b.width, b.height) == (1024, 1024) for b in buckets)


def test_explicit_buckets_are_checked_naming_the_entry():
    assert ([(b.width, b.height) for b in parse_image_buckets("1024x1024, 1152x896", 1024)]
            == [(1024, 1024), (1152, 896)])
    with pytest.raises(ConfigError, match="1000x1024.*multiple of 16; nearest: 992 or 1008"):
        parse_image_buckets("1000x1024", 1024)
    with pytest.raises(ConfigError, match="listed twice"):
        parse_image_buckets("64x64,64x64", 64)
    with pytest.raises(ConfigError, match="not WxH"):
        parse_image_buckets("64x64x1", 64)


def test_an_image_covers_its_nearest_aspect_bucket_centre_cropped(tmp_path):
    image = Image.new("RGB", (300, 100), (10, 20, 30))
    path = tmp_path / "wide.png"
    image.save(path)
    spec = ImageSpec(image_size=64, buckets=((64, 32), (32, 64), (48, 48)))
    prepared = prepare_image(path.read_bytes(), spec)
    assert tuple(prepared.pixels.shape) == (3, 32, 64)  # 3:1 is nearest 2:1
    assert prepared.crop_box == (50, 0, 250, 100)  # the centred 2:1 box, resized to 64x32


def _settings(settings_for, out, data, model, buckets="64x32,32x64,48x48", **output):
    return settings_for(out, data, model, image={"buckets": buckets},
                        output={"shard_size": 3, "on_existing": "resume", **output})


def _members(out: Path) -> dict[str, list[dict]]:
    metas = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as archive:
            metas[tar.name] = [json.loads(archive.extractfile(m).read()) for m in archive.getmembers()
                               if m.name.endswith(".meta.json")]
    return metas


def test_bucketed_run_one_bucket_per_shard_validated_and_loaded_by_size(settings_for, tiny_model, demo_data, tmp_path):
    out = tmp_path / "out"
    result = run(_settings(settings_for, out, demo_data, tiny_model), "preencoded",
                 ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 12 and result.validation["ok"]
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["settings"]["image"]["buckets"] == ["64x32", "32x64", "48x48"]
    assert plan["expected"]["buckets"] == {"64x32": [16, 4, 8], "32x64": [16, 8, 4], "48x48": [16, 6, 6]}
    for unit in plan["units"]:
        [metas] = [m for name, m in _members(out).items() if name == contract.shard_name(unit["unit"])]
        assert {"x".join(map(str, m["bucket"])) for m in metas} == {unit["bucket"]}
    per_bucket = validate_dataset(out, previews=0, full=True).summary["samples_per_bucket"]  # every sample
    assert sum(per_bucket.values()) == 12 and set(per_bucket) <= {"64x32", "32x64", "48x48"}
    # Latent statistics per bucket: each bucket's are those of its own stored latents, taken at once.
    stats = torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)
    by_bucket: dict[str, list[torch.Tensor]] = {}
    for fields in shard_samples(out).values():
        bucket = "x".join(map(str, json.loads(fields[contract.META])["bucket"]))
        by_bucket.setdefault(bucket, []).append(load_tensor(fields[contract.LATENTS]))
    assert sorted(stats["buckets"]) == sorted(by_bucket) == sorted(per_bucket) and len(by_bucket) > 1
    for bucket, latents in by_bucket.items():
        mean, std, _ = direct(latents)
        got = stats["buckets"][bucket]
        assert int(got["samples"]) == len(latents) == per_bucket[bucket], bucket
        assert int(got["count"]) == sum(x[0].numel() for x in latents), bucket
        assert close32(got["mean"], mean) and close32(got["std"], std), bucket

    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from diffprep.writer.cooker import FluxBucketedTaskEncoder

    dataset = get_train_dataset(out, batch_size=2, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=FluxBucketedTaskEncoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    sizes = [tuple(batch.latents.shape) for batch in get_loader(dataset)]
    assert sum(shape[0] for shape in sizes) == 12  # every batch stacked: one latent size each


def test_an_append_keeps_every_old_sample_in_its_bucket(settings_for, tiny_model, demo_data, tmp_path):
    out = tmp_path / "out"
    run(_settings(settings_for, out, demo_data, tiny_model), "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    for i, size in enumerate([(200, 90), (90, 200)]):
        Image.new("RGB", size, (200, 30 * i, 40)).save(demo_data / "images" / f"new{i}.png")
        (demo_data / "captions" / f"new{i}.txt").write_text(f"new {i}")
    result = run(_settings(settings_for, out, demo_data, tiny_model), "preencoded",
                 ask=lambda *a, **k: pytest.fail("asked"))
    assert result.action == "resume" and result.samples == 14
    after = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    assert {name: after[name] for name in before} == before  # old shards untouched
    new = {name: m for name, m in _members(out).items() if name not in before}
    assert sorted(m["bucket"] for metas in new.values() for m in metas) == [[32, 64], [64, 32]]
    assert len(new) == 2  # the two new images: a unit each, in their own buckets
