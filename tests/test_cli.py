"""The diffprep command end to end on the demo data, through a real Prefect server and real Energon."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# Prefect's console log handler keeps the stream it finds when prefect is first imported: import it
# here, at collection, so it holds pytest's session stream rather than one test's capsys buffer.
import diffprep.flows.encode  # noqa: F401

from diffprep import contract
from diffprep.cli import build_parser, main, overrides_from
from diffprep.tools.demo import write_demo_dataset
from diffprep.writer.shards import read_manifests

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("cli")
    data = write_demo_dataset(root / "demo-data", samples=12)
    return root, data, tiny_model


def _encode_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "4", "--precision", "fp32",
            "--image-size", "32", "--t5-max-length", "16", "--min-psnr", "0", *extra]


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_flags_typed_are_the_only_overrides():
    args = build_parser().parse_args(["encode", "--batch-size", "8", "--no-center-crop", "--no-finalize"])
    assert overrides_from(args) == {
        "model": {"batch_size": "8"},
        "image": {"center_crop": False},
        "finalize": {"enabled": False},
    }
    assert overrides_from(build_parser().parse_args(["encode"])) == {}


def test_encode_validate_finalize_end_to_end(prefect_server, demo_inputs, tmp_path, capsys):
    _root, data, model = demo_inputs
    out = tmp_path / "out"
    assert main(_encode_args(data, model, out, "--train-split", "1.0")) == 0
    printed = capsys.readouterr().out
    assert "samples written: 12" in printed and "validation: passed" in printed

    shards = sorted(p.name for p in out.glob("*.tar"))
    assert shards == ["000000.tar", "000001.tar", "000002.tar"]
    for name in (contract.DATASET_YAML, contract.SPLIT_YAML, contract.INFO_JSON):
        assert (out / contract.NV_META / name).is_file()
    manifests = read_manifests(out)
    assert [m.count for m in manifests.values()] == [4, 4, 4]
    assert manifests[1].keys == [contract.sample_key(1, i) for i in range(4)]
    empty = torch.load(out / contract.STATE_DIR / contract.EMPTY_PROMPT, weights_only=True)
    assert empty["prompt_embeds"].shape[0] == 16
    # Primus's CFG dropout files: the same empty caption, float32 with a batch dimension, plain .npy.
    t5 = np.load(out / contract.EMPTY_ENCODINGS_DIR / contract.T5_EMPTY, allow_pickle=False)
    clip = np.load(out / contract.EMPTY_ENCODINGS_DIR / contract.CLIP_EMPTY, allow_pickle=False)
    assert (t5.dtype, t5.shape, clip.dtype, clip.shape) == (np.float32, (1, 16, 32), np.float32, (1, 32))
    assert torch.equal(torch.from_numpy(t5)[0], empty["prompt_embeds"].float())
    assert torch.equal(torch.from_numpy(clip)[0], empty["pooled_prompt_embeds"].float())

    assert main(["validate", str(out)]) == 0
    # Re-splitting finalized shards moves them: refused without --replace-split (no terminal to ask on).
    assert main(["finalize", str(out), "--train-split", "0.34"]) == 2
    assert "--replace-split" in capsys.readouterr().err
    assert main(["finalize", str(out), "--train-split", "0.34", "--replace-split"]) == 0
    split = (out / contract.NV_META / contract.SPLIT_YAML).read_text()
    assert "val" in split and "test" in split

    module = subprocess.run([sys.executable, "-m", "diffprep.validation", str(out), "--encoding", "preencoded"],
                            capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert module.returncode == 0, module.stdout + module.stderr

    # Same settings again: nothing to encode, shards untouched, the recorded split kept.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    capsys.readouterr()
    assert main(_encode_args(data, model, out, "--train-split", "0.34")) == 0
    assert "complete" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")} == before


def test_same_inputs_give_identical_bytes(prefect_server, demo_inputs, tmp_path):
    _root, data, model = demo_inputs
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(_encode_args(data, model, first, "--no-finalize")) == 0
    assert main(_encode_args(data, model, second, "--no-finalize")) == 0
    assert _hashes(first) == _hashes(second) and len(_hashes(first)) == 3


def test_existing_output_needs_a_choice(prefect_server, demo_inputs, tmp_path, capsys):
    _root, data, model = demo_inputs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "000000.tar").write_bytes(b"not ours")
    before = _tree(out)

    # With a Prefect server the run pauses for an answer; unanswered, it stops and changes nothing.
    assert main(_encode_args(data, model, out, "--approval-timeout", "10")) == 2
    err = capsys.readouterr().err
    assert "no answer within 10 s" in err and "--on-existing" in err and "notes.txt" in err
    assert _tree(out) == before

    assert main(_encode_args(data, model, out, "--on-existing", "abort")) == 2
    assert "aborted" in capsys.readouterr().err
    assert _tree(out) == before

    # No dataset of diffprep's is there to keep as it is: reuse is refused, naming why.
    assert main(_encode_args(data, model, out, "--on-existing", "reuse")) == 2
    assert "cannot reuse" in capsys.readouterr().err
    assert _tree(out) == before

    assert main(_encode_args(data, model, out, "--on-existing", "new-dir", "--no-finalize")) == 0
    assert _tree(out) == before
    assert len(list((tmp_path / "out-v2").glob("*.tar"))) == 3

    # 000000.tar is no file of diffprep's, and this run writes a shard of that name: overwrite cannot keep it.
    assert main(_encode_args(data, model, out, "--on-existing", "overwrite", "--no-finalize")) == 2
    err = capsys.readouterr().err
    assert "cannot overwrite" in err and "`000000.tar`" in err and "new-dir" in err
    assert _tree(out) == before
    (out / "000000.tar").unlink()
    assert main(_encode_args(data, model, out, "--on-existing", "overwrite", "--no-finalize")) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert _hashes(out) == _hashes(tmp_path / "out-v2")


def test_other_settings_on_existing_output_are_refused(prefect_server, demo_inputs, tmp_path, capsys):
    _root, data, model = demo_inputs
    out = tmp_path / "out"
    assert main(_encode_args(data, model, out, "--no-finalize")) == 0
    before = _tree(out)
    capsys.readouterr()
    assert main(_encode_args(data, model, out, "--no-finalize", "--image-size", "48", "--on-existing", "resume")) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert _tree(out) == before


def test_max_samples_and_appends_keep_planned_units(prefect_server, tmp_path, tiny_model):
    data = write_demo_dataset(tmp_path / "data", samples=6)
    out = tmp_path / "out"
    assert main(_encode_args(data, tiny_model, out, "--no-finalize", "--max-samples", "5")) == 0
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert [len(u["source_ids"]) for u in plan["units"]] == [4, 1]
    first = _hashes(out)

    write_demo_dataset(data, samples=10)  # the source grows (same first 6 files)
    assert main(_encode_args(data, tiny_model, out, "--no-finalize")) == 0
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert [len(u["source_ids"]) for u in plan["units"]] == [4, 1, 4, 1]
    after = _hashes(out)
    assert {k: after[k] for k in first} == first


def test_rejects_stop_the_run_until_accepted(prefect_server, tmp_path, tiny_model, capsys):
    data = write_demo_dataset(tmp_path / "data", samples=4)
    (data / "images" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (data / "captions" / "broken.txt").write_text("a broken file")
    out = tmp_path / "out"
    # 1 of 5 rejected: more than the 10 % accepted ahead of time, and nobody answers the question.
    assert main(_encode_args(data, tiny_model, out, "--accept-rejects", "0.1", "--approval-timeout", "10")) == 2
    err = capsys.readouterr().err
    assert "broken.jpg" in err and "image_decode_error" in err and "--accept-rejects 0.2000" in err
    assert not (out / contract.NV_META).exists()

    assert main(_encode_args(data, tiny_model, out, "--accept-rejects", "0.2")) == 0
    printed = capsys.readouterr().out
    assert "rejected: 1" in printed and "image_decode_error: 1" in printed and "0 encoded this run" in printed


def test_bad_settings_fail_before_prefect(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  batchsize: 4\n")
    assert main(["encode", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "batchsize" in err and "model" in err
    assert main(["encode", "--source-type", "directory", "--output-dir", str(tmp_path), "--compress"]) == 2
    assert "input_dir" in capsys.readouterr().err


def test_a_user_error_in_a_run_prints_its_message_without_a_traceback(prefect_server, tiny_model, tmp_path):
    # What a new user meets first: the folders made, nothing in them yet. The command runs the flow on the
    # session's server; the error's message says what to do, so the terminal shows no traceback for it.
    from prefect.settings import PREFECT_API_URL

    for sub in ("images", "captions"):
        (tmp_path / "src" / sub).mkdir(parents=True)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    run = subprocess.run(
        [sys.executable, "-m", "diffprep", "encode", "--input-dir", str(tmp_path / "src"), "--model-path",
         str(tiny_model), "--output-dir", str(tmp_path / "out"), "--image-size", "32", "--min-psnr", "0"],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    message = f"source.input_dir {tmp_path / 'src'} holds no media file and no caption"
    assert f"diffprep: error: {message}" in run.stderr
    assert "Encountered exception during execution: SourceError" in run.stderr  # Prefect's own line stays
    assert "Traceback" not in run.stderr and "raise SourceError" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_default_model_offline_and_not_cached_is_one_error_line(prefect_server, demo_inputs, tmp_path):
    # The default model (FLUX.1-dev on the hub), offline, nothing in the cache: one `diffprep: error:` naming the
    # encoder and the three ways out, not hundreds of lines of LocalEntryNotFoundError tracebacks.
    from prefect.settings import PREFECT_API_URL

    _root, data, _model = demo_inputs
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "empty-hf-home"), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "diffprep", "encode", "--input-dir", str(data), "--output-dir",
                          str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "diffprep: error: VAE: black-forest-labs/FLUX.1-dev is not in the Hugging Face cache" in run.stderr
    assert "HF_HUB_OFFLINE is set" in run.stderr and "hf download" in run.stderr and "--model-path" in run.stderr
    assert "Traceback" not in run.stderr and "LocalEntryNotFoundError" not in run.stderr, run.stderr
    assert len((run.stdout + run.stderr).splitlines()) < 40, run.stdout + run.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("samples", [3, 6, 8, 10, 24])
def test_a_small_demo_still_fills_its_three_splits(samples):
    """`diffprep demo --samples 8` planned one shard of 8 for train, val and test, and stopped: a demo's shards are
    as many as its splits need (the default demos' sizes unchanged)."""
    from diffprep.cli import demo_shard_size
    from diffprep.run.energon import planned_split

    for most in (8, 4):  # the Flux demo's shard size, the Wan demo's
        shards = -(-samples // demo_shard_size(samples, most))
        counts, _warning = planned_split(shards, 0.8)  # raises ConfigError when train, val and test cannot all fill
        assert all(counts[split] > 0 for split in ("train", "val", "test")), (samples, most, counts)
    assert demo_shard_size(24, 8) == 8 and demo_shard_size(10, 4) == 4
