"""Wan (video) runs hold what image runs hold: a bucket output equals a folder's, appends add units and touch no
old shard, a run killed mid-unit (two workers) and run again equals an uninterrupted one-worker run; the sanity
batch runs at the largest bucket and projects every bucket; `diffprep decode` on the dataset; `diffprep demo`.

One source for all: real mp4 clips and two images (one-frame clips, a ``F = 1`` bucket), the tiny Wan set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import sys
import time
from pathlib import Path

import av
import pytest
from PIL import Image

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler must bind to pytest's session stream)
from diffprep import contract
from diffprep.cli import main
from diffprep.config import load_settings
from diffprep.tools.demo import write_demo_clips
from diffprep.run.failpoints import ENV as FAILPOINT_ENV
from diffprep.media.buckets import parse_bucket
from diffprep.phases.pipeline import run
from diffprep.writer.plan import read_plan
from diffprep.writer.shards import read_manifests

REPO = Path(__file__).resolve().parents[1]
BUCKET = "diffprep-wan"  # created by the admin fixture (conftest.py)
# 24x32x9 is the largest (6912 pixels): the sanity batch must run there, not at the first unit's 32x24x5.
BUCKETS = "32x24x5;24x32x9;24x24x5;32x24x1"
pytestmark = pytest.mark.slow


def _fail(*args, **kwargs):
    pytest.fail(f"asked {args}")


def _args(data: Path, model: Path, out: str, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", out, "--shard-size", "2", "--batch-size", "2", "--precision", "fp32", "--device", "cpu",
            "--t5-max-length", "16", "--latent-mode", "mode", "--min-psnr", "0", "--train-split", "1.0",
            "--resolution-buckets", BUCKETS, *extra]


def _settings(data: Path, model: Path, out: str, **output):
    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": out, "shard_size": 2, **output},
        "model": {"model_path": str(model), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "t5_max_length": 16, "latent_mode": "mode", "min_psnr": 0.0},
        "video": {"resolution_buckets": BUCKETS},
        "finalize": {"train_split": 1.0},
    })


def _snapshot(out: Path) -> dict[str, str]:
    """What must be identical to an uninterrupted run: shards, manifests, the plan, Energon's counts and split."""
    files = sorted(out.glob("*.tar")) + sorted((out / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json"))
    files += [out / contract.STATE_DIR / contract.PLAN_JSON, out / contract.NV_META / contract.SPLIT_YAML,
              out / contract.NV_META / contract.INFO_JSON]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _write_image(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> None:
    image = Image.new("RGB", size, colour)
    image.paste((250, 250, 250), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    image.save(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Five clips (one of 3 frames: into the F = 1 bucket, no bucket is too long for it) and two images."""
    root = write_demo_clips(tmp_path_factory.mktemp("wan-runs") / "data", samples=5)
    (root / "images").mkdir()
    for stem, size, colour in (("img-wide", (64, 48), (200, 40, 40)), ("img-square", (40, 40), (40, 40, 200))):
        _write_image(root / "images" / f"{stem}.png", size, colour)
        (root / "captions" / f"{stem}.txt").write_text(f"a still {stem}\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def reference(data, tiny_wan, tmp_path_factory) -> Path:
    """An uninterrupted one-worker run into a folder (do not modify; copy it)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    result = run(_settings(data, tiny_wan, str(out)), "preencoded", ask=_fail)
    assert result.samples == 7 and not result.rejected and result.validation["ok"]
    return out


def test_mixed_clips_and_images_and_the_sanity_batch_at_the_largest_bucket(reference, tiny_wan):
    plan = read_plan(reference)
    assert [(u.bucket, u.source_ids) for u in plan.units] == [  # full units as they fill, then the rest
        ("32x24x5", ["00000.mp4", "00002.mp4"]), ("32x24x1", ["00004.mp4", "img-square.png"]),
        ("24x32x9", ["00001.mp4"]), ("24x24x5", ["00003.mp4"]), ("32x24x1", ["img-wide.png"])]
    metas = {}
    for unit in plan.units:
        with tarfile.open(reference / unit.shard) as tar:
            for member in tar:
                if member.name.endswith(contract.META):
                    meta = json.loads(tar.extractfile(member).read())
                    metas[meta["source_id"]] = meta
    # Images are one-frame clips of the F = 1 bucket, the 3-frame clip too (its first frame).
    assert {sid: m["bucket"] for sid, m in metas.items() if m["bucket"][2] == 1} == {
        "img-wide.png": [32, 24, 1], "img-square.png": [32, 24, 1], "00004.mp4": [32, 24, 1]}
    assert plan.expected["buckets"]["32x24x1"] == [16, 1, 3, 4]

    report = json.loads((reference / contract.STATE_DIR / contract.SANITY_DIR / contract.SANITY_REPORT).read_text())
    assert report["bucket"] == "24x32x9" and report["shapes"]["latents.pth"] == [16, 3, 4, 3]
    assert set(report["buckets"]) == {"32x24x5", "24x32x9", "24x24x5", "32x24x1"}
    # Memory per bucket: the growth measured over the baseline at the sanity bucket (one clip, a batch of 1),
    # scaled by the larger of the volume and area ratios and by the bucket's batch (clips.project_buckets).
    buckets = report["buckets"]
    baseline, peak = report["baseline_memory_bytes"], report["peak_memory_bytes"]
    growth = peak - baseline
    assert baseline > 0 and growth >= 0
    assert buckets["24x32x9"]["peak_memory_bytes"] == peak  # as measured
    assert buckets["32x24x5"]["peak_memory_bytes"] == baseline + 2 * growth  # the same area, a batch of 2
    assert buckets["32x24x1"]["peak_memory_bytes"] == baseline + 2 * growth  # images and a frame: area again
    assert buckets["24x24x5"]["peak_memory_bytes"] == int(baseline + growth * 0.75)  # 3/4 of the area, 1 clip
    assert {name: (e["samples"], e["bytes"] > 0) for name, e in buckets.items()} == {
        "32x24x5": (2, True), "24x32x9": (1, True), "24x24x5": (1, True), "32x24x1": (3, True)}


def test_bucket_output_equals_the_folder_and_an_append_keeps_old_shards(
        reference, data, tiny_wan, admin, proxy, aws_env, tmp_path):
    url = f"s3://{BUCKET}/runs/{tmp_path.name}"
    result = run(_settings(data, tiny_wan, url, s3_endpoint_url=proxy.url), "preencoded", ask=_fail)
    assert result.out_dir == url and result.validation["ok"]
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    for name in _snapshot(reference):
        body = admin.get_object(Bucket=BUCKET, Key=prefix + name)["Body"].read()
        assert body == (reference / name).read_bytes(), name

    # Two more clips in the source: a re-run plans units for them only; every old shard stays byte for byte.
    grown = tmp_path / "grown"
    shutil.copytree(data, grown)
    extra = write_demo_clips(tmp_path / "extra", samples=4)
    for stem in ("00000", "00001"):
        shutil.copy(extra / "videos" / f"{stem}.mp4", grown / "videos" / f"new-{stem}.mp4")
        shutil.copy(extra / "captions" / f"{stem}.txt", grown / "captions" / f"new-{stem}.txt")
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    old_units = read_plan(reference).units
    appended = run(_settings(grown, tiny_wan, str(out), on_existing="resume"), "preencoded", ask=_fail)
    assert appended.action == "resume" and appended.encoded_units == 2 and appended.samples == 9
    plan = read_plan(out)
    assert plan.units[:len(old_units)] == old_units
    assert [(u.source_ids, u.bucket) for u in plan.units[len(old_units):]] == [
        (["new-00000.mp4"], "32x24x5"), (["new-00001.mp4"], "24x32x9")]
    assert {p.name: p.read_bytes() for p in out.glob("*.tar") if p.name in before} == before
    assert appended.validation["ok"] and appended.validation["summary"]["samples"] == 9


def test_killed_mid_unit_with_two_workers_then_rerun_equals_one_worker(prefect_server, reference, data, tiny_wan,
                                                                       tmp_path):
    """Two worker processes; the first to reach its third sample write SIGKILLs itself (mid-unit: it has committed
    one unit already). The re-run, one worker, resumes: every shard equals the uninterrupted one-worker run's."""
    from prefect.settings import PREFECT_API_URL

    out = tmp_path / "out"
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO),
                        FAILPOINT_ENV: "shard-write@3"}
    killed = subprocess.run([sys.executable, "-m", "diffprep",
                             *_args(data, tiny_wan, str(out), "--devices", "cpu:2")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert "terminated abruptly" in killed.stderr, killed.stderr[-2000:]
    committed = read_manifests(out)
    assert 1 <= len(committed) < 5, sorted(committed)  # written by the two workers before the kill
    assert main(_args(data, tiny_wan, str(out), "--on-existing", "resume")) == 0
    assert _snapshot(out) == _snapshot(reference)
    leftovers = [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name.startswith("lock")]
    assert leftovers == []


def test_decode_cli_writes_each_clip_as_mp4_and_a_frame_strip(reference, tmp_path, capsys):
    previews = tmp_path / "previews"
    assert main(["decode", str(reference), "--samples", "3", "--to", str(previews), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    manifests = read_manifests(reference)
    keys = [key for _, m in sorted(manifests.items()) for key in m.keys]
    picked = [keys[i * len(keys) // 3] for i in range(3)]
    for key in picked:
        unit = int(key.split("_")[0])
        bucket = parse_bucket(read_plan(reference).unit(unit).bucket)
        assert f"{key}  PSNR" in printed and "dB" in printed.split(f"{key}  PSNR")[1].splitlines()[0]
        with av.open(str(previews / f"{key}.mp4")) as container:
            frames = list(container.decode(video=0))
        assert len(frames) == bucket.frames and (frames[0].width, frames[0].height) == (bucket.width, bucket.height)
        with Image.open(previews / f"{key}.png") as strip, Image.open(previews / f"{key}.source.png") as source:
            assert strip.size == source.size == (bucket.width * bucket.frames, bucket.height)
    assert (previews / "contact_sheet.png").is_file()


def test_demo_wan_runs_the_whole_job(prefect_server, tmp_path, capsys):
    started = time.perf_counter()
    assert main(["demo", "--family", "wan", "--workdir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    print(f"diffprep demo --family wan: {time.perf_counter() - started:.1f} s")
    assert "validation: passed" in printed and "rejected too_few_frames: 2" in printed
    assert (tmp_path / "demo-wan-out" / contract.NV_META / contract.DATASET_YAML).is_file()
