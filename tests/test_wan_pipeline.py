"""Wan (video) through the whole pipeline: clips planned into buckets, encoded, audited, finalized, validated,
loaded through Energon one bucket per batch, and equal to diffusers' own Wan code.

Real mp4 clips written by ``write_demo_clips``, the tiny Wan set in its diffusers layout, real Energon.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from diffprep import contract
from diffprep.config import load_settings
from diffprep.tools.demo import write_demo_clips
from diffprep.encodings import encoding_for, get_encoding
from diffprep.run.approvals import ApprovalRefused
from diffprep.errors import ConfigError
from diffprep.media.buckets import Bucket
from diffprep.media.video import prepare_clip
from diffprep.phases.pipeline import run
from diffprep.writer.plan import Plan, UnitPlan, plan_units, read_plan
from diffprep.writer.shards import load_tensor
from flow_runs import shard_samples

BUCKETS = "32x24x5;24x32x5;24x24x5"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return write_demo_clips(tmp_path_factory.mktemp("clips") / "data", samples=6)


def _settings(out: Path, data: Path, model: Path, **video):
    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 2, "on_existing": "resume", "accept_rejects": 0.5},
        "model": {"model_path": str(model), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "t5_max_length": 16, "latent_mode": "mode", "min_psnr": 0.0},
        "video": {"resolution_buckets": BUCKETS, **video},
        "finalize": {"train_split": 1.0},
    })


def test_units_hold_one_bucket_each_and_appends_keep_old_units():
    buckets = {"a": "8x8x5", "b": "16x8x5", "c": "8x8x5", "d": None, "e": "8x8x5", "f": "16x8x5"}
    units, _, _ = plan_units(list(buckets), shard_size=2, bucket_of=buckets.get)
    assert [(u.source_ids, u.bucket) for u in units] == [
        (["a", "c"], "8x8x5"), (["b", "f"], "16x8x5"), (["e"], "8x8x5"), (["d"], None)]

    previous = Plan("fp", {}, {}, {}, units)
    more = buckets | {"g": "16x8x5"}
    again, _, _ = plan_units(list(more), shard_size=2, previous=previous, bucket_of=more.get)
    assert again[:4] == units and again[4] == UnitPlan(4, ["g"], "16x8x5")
    assert "bucket" not in Plan("fp", {}, {}, {}, [UnitPlan(0, ["x"])]).to_json()["units"][0]  # image plans as before


def test_family_is_detected_and_part_of_the_plan(tiny_wan, tiny_model, tmp_path):
    settings = _settings(tmp_path / "out", tmp_path, tiny_wan)
    assert encoding_for(settings, "preencoded") == "wan"
    assert encoding_for(settings.model_copy(update={"model": settings.model.model_copy(update={"family": "flux"})}),
                        "preencoded") == "preencoded"
    flux = settings.model_copy(update={"model": settings.model.model_copy(update={"model_path": str(tiny_model)})})
    assert encoding_for(flux, "preencoded") == "preencoded"
    byte, expected = get_encoding("wan").plan_settings(settings, None)
    assert byte["encoders"]["family"] == "wan" and byte["video"]["buckets"] == BUCKETS.split(";")
    assert expected["buckets"] == {"32x24x5": [16, 2, 3, 4], "24x32x5": [16, 2, 4, 3], "24x24x5": [16, 2, 3, 3]}
    assert expected["prompt_embeds"] == [16, 32]
    with pytest.raises(ConfigError, match="4k\\+1.*nearest: 5 or 9"):
        get_encoding("wan").plan_settings(_settings(tmp_path, tmp_path, tiny_wan, resolution_buckets="32x24x7"), None)


def test_clips_end_to_end_equal_diffusers_and_load_one_bucket_per_batch(tiny_wan, clips, tmp_path):
    out = tmp_path / "out"
    result = run(_settings(out, clips, tiny_wan), "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["encoding"] == "wan"
    assert result.samples == 5 and result.rejects_by_reason == {"too_few_frames": 1}
    assert result.validation["ok"]

    # One bucket per shard, as planned; the short clip in a unit of its own, named with its frame count.
    assert [(u["count"], u.get("bucket")) for u in plan["units"]] == [
        (2, "32x24x5"), (1, "32x24x5"), (1, "24x32x5"), (1, "24x24x5"), (1, None)]
    assert not (out / contract.shard_name(4)).exists()  # the short clip's unit: every sample rejected, no tar
    for unit in plan["units"][:4]:
        with tarfile.open(out / contract.shard_name(unit["unit"])) as archive:
            buckets = {"x".join(map(str, json.loads(archive.extractfile(m).read())["bucket"]))
                       for m in archive.getmembers() if m.name.endswith(".meta.json")}
        assert buckets == ({unit["bucket"]} if unit.get("bucket") else set())
    rejects = [r for p in sorted((out / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json"))
               for r in json.loads(p.read_text())["rejects"]]
    assert {r["reason"] for r in rejects} == {"too_few_frames"}
    assert all("3 frames" in r["detail"] and "shortest" in r["detail"] for r in rejects)

    # Each sample equals diffusers' WanPipeline: the VAE posterior mode, normalized; encode_prompt's text. The
    # reference runs the pipeline's batches (a unit's samples two at a time): CPU float bits depend on the batch.
    pipe = WanPipeline.from_pretrained(tiny_wan, transformer=None, dtype=torch.float32)
    shape = (1, pipe.vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(shape)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(shape)
    stored = shard_samples(out)
    batches: dict[tuple[str, int], list[str]] = {}
    for key in sorted(stored):
        unit, index = key.split("_")
        batches.setdefault((unit, int(index) // 2), []).append(key)
    for keys in batches.values():
        videos, captions = [], []
        for key in keys:
            meta = json.loads(stored[key]["meta.json"])
            bucket = Bucket(*meta["bucket"])
            assert meta["frame_indices"] == list(range(bucket.frames))
            source = clips / "videos" / meta["source_id"]
            frames = prepare_clip(source.read_bytes(), [bucket]).pixels
            videos.append(frames.permute(1, 0, 2, 3).float() / 255.0 * 2.0 - 1.0)
            captions.append(stored[key]["caption.txt"].decode())
        with torch.no_grad():
            want = (pipe.vae.encode(torch.stack(videos)).latent_dist.mode() - mean) * inv_std
            text, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=16,
                                         device="cpu")
        for i, key in enumerate(keys):
            assert torch.equal(load_tensor(stored[key]["latents.pth"]), want[i])
            assert torch.equal(load_tensor(stored[key]["prompt_embeds.pth"]), text[i])

    # Energon: batches never mix buckets.
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from diffprep.writer.cooker import VideoPreencodedTaskEncoder

    dataset = get_train_dataset(out, batch_size=2, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=VideoPreencodedTaskEncoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    seen = 0
    for batch in get_loader(dataset):
        assert len(set(batch.bucket)) == 1
        assert batch.latents.shape[0] == len(batch.bucket) and batch.prompt_embeds.shape[1:] == (16, 32)
        seen += len(batch.bucket)
    assert seen == 5

    # Decode-and-verify: the stored latents back to frames of their bucket.
    from diffprep.validation.decode import read_samples

    stored = read_samples(out, 2)
    frames, _ = get_encoding("wan").decode_stored(stored, read_plan(out), device="cpu")
    buckets = [Bucket(*json.loads(s.fields["meta.json"])["bucket"]) for s in stored]
    assert [tuple(f.shape) for f in frames] == [(b.frames, 3, b.height, b.width) for b in buckets]
    assert all(f.dtype == torch.uint8 for f in frames)

    # A re-run finds everything done and changes nothing.
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    again = run(_settings(out, clips, tiny_wan), "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert again.action == "complete" and {p.name: p.read_bytes() for p in out.glob("*.tar")} == before


def test_too_short_clips_are_asked_about_with_the_exact_bucket_flag_then_accepted(tiny_wan, clips, tmp_path):
    asked = []
    out = tmp_path / "out"
    settings = _settings(out, clips, tiny_wan)
    settings.output.accept_rejects = None

    def ask(question, preset=None, *, release=False):
        asked.append(question)
        return question.check("abort")

    with pytest.raises(ApprovalRefused, match="aborted"):
        run(settings, "preencoded", ask=ask)
    [question] = asked
    assert question.key == "rejected-samples"
    assert '--resolution-buckets "32x24x5;24x32x5;24x24x5;32x24x1;24x32x1;24x24x1"' in question.description
    assert "shortest has 3 frames" in question.description
    assert not (out / contract.NV_META).exists(), "an abort finalizes nothing"

    # The accept path, answered ahead of time with the fraction the question names: the encoded units are kept,
    # the dataset is finalized without the short clip, which the audit names.
    fraction = float(question.preset_hint.split()[1])
    settings.output.accept_rejects = fraction
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.action == "complete" and result.samples == 5 and result.rejects_by_reason == {"too_few_frames": 1}
    audit = json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    [rejected] = audit["rejected_ids"]
    assert rejected["source_id"] == "00004.mp4" and rejected["reason"] == "too_few_frames"
    assert "a clip of 3 frames" in rejected["detail"] and audit["by_reason"] == {"too_few_frames": 1}
    info = json.loads((out / contract.NV_META / contract.INFO_JSON).read_text())
    assert sum(info["shard_counts"].values()) == 5
    assert "00004.mp4" not in {json.loads(s["meta.json"])["source_id"] for s in shard_samples(out).values()}


def test_a_metadata_file_with_paths_relative_to_it(tiny_wan, clips, tmp_path):
    """The LTX trainer's dataset file: paths relative to the file's folder; a row whose file is gone is named."""
    listing = clips / "dataset.jsonl"
    listing.write_text(json.dumps({"caption": "a clip", "media_path": "videos/00001.mp4"}) + "\n"
                       + json.dumps({"caption": "gone", "media_path": "videos/missing.mp4"}) + "\n")
    settings = _settings(tmp_path / "out", clips, tiny_wan)
    settings.source.type, settings.source.input_dir, settings.source.metadata_file = "metadata", None, str(listing)
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 1 and result.rejects_by_reason == {"media_not_found": 1}
    [sample] = shard_samples(tmp_path / "out").values()
    assert json.loads(sample["meta.json"])["bucket"] == [24, 32, 5]


def test_fastgen_layout_writes_latent_and_the_umt5_sequence_as_txt_emb(tiny_wan, clips, tmp_path):
    """Wan under --layout fastgen (consumer-formats.md B): ``latent.pth`` and ``txt_emb.pth`` [L, D] (one tensor,
    not a tuple), the empty caption as the default negative prompt, shard_counts.json; validate and decode read it."""
    from diffprep.validation.decode import decode_dataset
    from fastgen_loader import fastgen_samples

    out = tmp_path / "out"
    settings = _settings(out, clips, tiny_wan)
    settings.output.layout, settings.output.max_samples = "fastgen", 2
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.validation["ok"] and result.samples == 2

    samples = fastgen_samples(out, {"real": contract.FASTGEN_LATENT, "condition": contract.FASTGEN_TXT_EMB})
    expected = read_plan(out).expected
    assert len(samples) == 2
    for sample in samples:
        assert isinstance(sample[contract.FASTGEN_TXT_EMB], torch.Tensor)
        assert list(sample[contract.FASTGEN_TXT_EMB].shape) == expected["prompt_embeds"] == [16, 32]
        assert sample[contract.FASTGEN_LATENT].shape[0] == 16 and sample[contract.FASTGEN_LATENT].ndim == 4
    negative = np.load(out / contract.NEG_PROMPT_EMB, allow_pickle=False)
    empty = torch.load(out / contract.STATE_DIR / contract.EMPTY_PROMPT, weights_only=True)["prompt_embeds"]
    assert negative.dtype == np.float32 and torch.equal(torch.from_numpy(negative), empty.float())
    assert not (out / contract.NEG_POOLED_PROMPT_EMB).exists()  # umT5 has no pooled embedding
    counts = json.loads((out / contract.SHARD_COUNTS_JSON).read_text())
    assert counts == {p.name: len({m.name.partition(".")[0] for m in tarfile.open(p)}) for p in out.glob("*.tar")}
    assert sum(counts.values()) == 2
    [clip] = decode_dataset(out, 1, device="cpu", local_only=True).previews
    assert clip.decoded.dtype == torch.uint8
