"""Wan depth latents (--depth-column, encodings/wan_depth.py, media/depth_video.py): the depth clip read frame for
frame with its clip, its rejects, and one fastgen run whose depth_latent.pth is the VAE's encode of those frames,
shaped as latent.pth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler bound at collection, as in test_ltx2_pipeline)

from diffprep import contract
from diffprep.config import load_settings
from diffprep.errors import ConfigError, RejectError
from diffprep.media.buckets import Bucket
from diffprep.media.clip_inputs import prepare_with_inputs
from diffprep.media.mp4 import mp4_bytes
from diffprep.media.video import ClipSpec
from diffprep.phases.pipeline import run
from diffprep.writer.plan import read_plan
from diffprep.writer.shards import load_tensor
from diffprep.run.threads import CpuRecord, planned_threads
from diffprep.sources.metadata import MetadataSource

FPS = 16.0
BUCKET = "32x24x5"


def clip(width: int, height: int, frames: int, seed: int, gray: bool = False) -> torch.Tensor:
    """Smooth moving frames (they survive H.264), uint8 [F, 3, H, W]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(3, height // 4 + 1, width // 4 + 1, generator=g)
    frames_ = []
    for f in range(frames):
        up = torch.nn.functional.interpolate(base[None], size=(height, width), mode="bilinear")[0]
        frames_.append((torch.roll(up, shifts=f, dims=2) * 255).to(torch.uint8))
    video = torch.stack(frames_)
    return video[:, :1].expand(-1, 3, -1, -1).contiguous() if gray else video


def spec() -> ClipSpec:
    return ClipSpec((Bucket(32, 24, 5),), inputs=("depth",))


def edge_depth(width: int, height: int, frames: int) -> torch.Tensor:
    """Gray depth frames, uint8 [F, 3, H, W]: frame f is 40 + 20 f left of x = 5 W / 12, 220 right of it."""
    video = torch.full((frames, 3, height, width), 220, dtype=torch.uint8)
    for f in range(frames):
        video[f, :, :, : 5 * width // 12] = 40 + 20 * f
    return video


def test_depth_clip_follows_its_clips_frames_crop_and_size():
    """A 48x24 clip in a 32x24 bucket is cropped to x in [8, 40): its depth clip's edge at x = 20 lands at x = 12,
    each kept frame is the depth clip's frame of the same index, gray in 3 channels; a half-size depth clip lands
    the same."""
    rgb = mp4_bytes(clip(48, 24, 9, 0), FPS)
    for name, depth in (("d.mp4", edge_depth(48, 24, 9)), ("h.mp4", edge_depth(24, 12, 9))):
        prepared = prepare_with_inputs(spec(), rgb, {"depth": (name, mp4_bytes(depth, FPS))}, video=True)
        got = prepared.depth.float()
        assert prepared.depth.shape == (5, 3, 24, 32) and prepared.depth.dtype == torch.uint8
        assert torch.equal(prepared.depth[:, 0], prepared.depth[:, 1])
        assert torch.equal(prepared.depth[:, 0], prepared.depth[:, 2])
        assert prepared.meta["depth"] == name
        for slot, index in enumerate(prepared.meta["frame_indices"]):
            assert (got[slot, 0, 4:20, 1:9] - (40 + 20 * index)).abs().mean() < 6, (name, slot)
            assert (got[slot, 0, 4:20, 16:31] - 220).abs().mean() < 6, (name, slot)


@pytest.mark.parametrize("name, depth, reason", [
    ("short.mp4", lambda: mp4_bytes(clip(48, 24, 7, 1), FPS), "depth_frame_mismatch"),
    ("square.mp4", lambda: mp4_bytes(clip(32, 32, 9, 1), FPS), "depth_size_mismatch"),
    ("broken.mp4", lambda: b"not a video at all", "depth_decode_error"),
])
def test_depth_rejects_name_both_sides(name, depth, reason):
    with pytest.raises(RejectError) as error:
        prepare_with_inputs(spec(), mp4_bytes(clip(48, 24, 9, 0), FPS), {"depth": (name, depth())}, video=True)
    assert error.value.reason == reason
    if reason == "depth_frame_mismatch":
        assert "7 frames" in error.value.detail and "9" in error.value.detail
    if reason == "depth_size_mismatch":
        assert "32x32" in error.value.detail and "48x24" in error.value.detail


def test_metadata_depth_column_rejects(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    (tmp_path / "d.mp4").write_bytes(b"y")
    rows = [{"video": "a.mp4", "caption": "c", "depth_path": "d.mp4"}, {"video": "a.mp4", "caption": "c"},
            {"video": "a.mp4", "caption": "c", "depth_path": "gone.mp4"}]
    listing = tmp_path / "rows.json"
    listing.write_text(json.dumps(rows))
    source = MetadataSource(str(listing), depth_key="depth_path")
    first, second, third = source.read(list(source.list_ids()))
    assert first.reject is None and first.extras["depth"] == ("d.mp4", b"y")
    assert second.reject.reason == "missing_depth" and "depth_path" in second.reject.detail
    assert third.reject.reason == "depth_not_found"
    with pytest.raises(Exception, match="not a column"):
        MetadataSource(str(listing), depth_key="depth")


def write_dataset(root: Path) -> Path:
    rows = []
    for i in range(2):
        (root / f"c{i}.mp4").write_bytes(mp4_bytes(clip(32, 24, 5 + 4 * i, 10 + i), FPS))
        (root / f"d{i}.mp4").write_bytes(mp4_bytes(clip(32, 24, 5 + 4 * i, 20 + i, gray=True), FPS))
        rows.append({"video": f"c{i}.mp4", "caption": f"clip {i}", "depth_path": f"d{i}.mp4"})
    listing = root / "dataset.json"
    listing.write_text(json.dumps(rows))
    return listing


def settings_for(out: Path, listing: Path, model: Path, **source):
    return load_settings(overrides={
        "source": {"type": "metadata", "metadata_file": str(listing), "depth_key": "depth_path", **source},
        "output": {"output_dir": str(out), "shard_size": 2, "layout": "fastgen"},
        "model": {"model_path": str(model), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "t5_max_length": 16, "latent_mode": "sample", "min_psnr": 0.0},
        "video": {"resolution_buckets": BUCKET},
        "finalize": {"train_split": 1.0},
    })


def never_ask(question, preset=None, *, release=False):
    pytest.fail(f"asked {question.key}: {question.title}")


def test_fastgen_depth_latents_are_the_vaes_encode_of_the_depth_frames(tiny_wan, tmp_path, monkeypatch):
    import webdataset.autodecode
    from fastgen_loader import fastgen_samples, fastgen_shard_counts
    from flow_runs import shard_samples

    from diffprep.families.wan import WanEncoders

    data = tmp_path / "data"
    data.mkdir()
    listing = write_dataset(data)
    result = run(settings_for(tmp_path / "out", listing, tiny_wan), "preencoded", ask=never_ask)
    assert result.samples == 2 and result.validation["ok"]
    samples = shard_samples(tmp_path / "out")
    encoders = WanEncoders.load(tiny_wan, device="cpu", dtype="fp32", latent_mode="sample", text_max_length=16)
    rows = json.loads(listing.read_text())
    cpu = CpuRecord.from_json(read_plan(tmp_path / "out").cpu)
    keys, depths, clips = sorted(samples), [], []
    for key in keys:
        latent = load_tensor(samples[key][contract.FASTGEN_LATENT], key=key, field=contract.FASTGEN_LATENT)
        depth = load_tensor(samples[key][contract.DEPTH_LATENT], key=key, field=contract.DEPTH_LATENT)
        assert depth.shape == latent.shape and depth.dtype == latent.dtype and not torch.equal(depth, latent)
        meta = json.loads(samples[key][contract.META])
        row = next(r for r in rows if r["video"] == meta["source_id"])
        assert meta["depth"] == row["depth_path"]
        prepared = prepare_with_inputs(spec(), (data / row["video"]).read_bytes(),
                                       {"depth": (row["depth_path"], (data / row["depth_path"]).read_bytes())},
                                       video=True)
        depths.append(prepared.depth)
        clips.append(prepared.pixels)
    with planned_threads(cpu, "cpu"):  # the plan's thread count and the unit's batch of 2: the same kernels' bits
        want_depth = encoders.encode_video(torch.stack(depths), [key + "/depth" for key in keys])
        want_latent = encoders.encode_video(torch.stack(clips), keys)
    for i, key in enumerate(keys):
        assert torch.equal(load_tensor(samples[key][contract.DEPTH_LATENT], key=key, field="d"), want_depth[i])
        assert torch.equal(load_tensor(samples[key][contract.FASTGEN_LATENT], key=key, field="l"), want_latent[i])

    # FastGen's VACE v2v loader: VideoLatentLoaderConfig's key map plus key_map["depth_latent"], every sample kept
    # (none lacks a member), .pth decoded by webdataset's handler with weights only; shard_counts.json exact.
    monkeypatch.setattr(webdataset.autodecode, "pytorch_weights_only", True)
    key_map = {"real": contract.FASTGEN_LATENT, "condition": contract.FASTGEN_TXT_EMB,
               "depth_latent": contract.DEPTH_LATENT}
    loaded = fastgen_samples(tmp_path / "out", key_map)
    assert [item["__key__"] for item in loaded] == keys
    assert sum(fastgen_shard_counts(tmp_path / "out", {}).values()) == len(loaded)
    for i, item in enumerate(loaded):
        assert torch.equal(item[contract.DEPTH_LATENT], want_depth[i])
        assert torch.equal(item[contract.FASTGEN_LATENT], want_latent[i])
        condition = item[contract.FASTGEN_TXT_EMB]  # umT5's [t5_max_length, hidden], as the fastgen layout writes it
        assert isinstance(condition, torch.Tensor) and condition.shape[0] == 16 and condition.dtype == torch.float32


def test_depth_column_is_refused_where_nothing_stores_it(tiny_model, tmp_path):
    """A family without depth latents, or a source without columns, names --depth-column instead of dropping it."""
    data = tmp_path / "data"
    data.mkdir()
    listing = write_dataset(data)
    with pytest.raises(ConfigError, match="--depth-column depth_path"):  # the tiny Flux set
        run(settings_for(tmp_path / "out", listing, tiny_model), "preencoded", ask=never_ask)
    settings = load_settings(overrides={"source": {"type": "directory", "input_dir": str(data), "depth_key": "d"}})
    from diffprep.sources import open_source

    with pytest.raises(Exception, match="--depth-column d"):
        open_source(settings.source)
