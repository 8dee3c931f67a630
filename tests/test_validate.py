"""Strict validation against real finalized datasets, each broken one way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffprep import contract
from diffprep.run.energon import finalize
from diffprep.errors import ConfigError, DatasetValidationError
from diffprep.validation import ValidationReport, validate_dataset
from latent_direct import close32
from test_energon import png_bytes, write_raw_unit, write_unit, write_units

REPO = Path(__file__).resolve().parents[1]


def make_dataset(tmp_path: Path, units: int = 3, samples: int = 2) -> tuple[Path, dict]:
    out = tmp_path / "out"
    written = write_units(out, range(units), samples)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)
    return out, written


def failed(report: ValidationReport) -> dict[str, str]:
    return {check.name: check.detail for check in report.checks if not check.ok}


class PickleBomb:
    """Unpickling this runs ``os.mkdir(marker)``: what a malicious .pth would do with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def pickle_bomb_pth(marker: Path) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(PickleBomb(marker), buffer)
    return buffer.getvalue()


def test_good_dataset_passes_and_saves_latent_stats(tmp_path: Path) -> None:
    out, written = make_dataset(tmp_path)
    progress = []
    # --full: the counts and statistics below are those of every sample (the default loads one per shard).
    report = validate_dataset(out, full=True,
                              progress=lambda stage, done, total: progress.append((stage, done, total)))

    assert report.ok, report.to_markdown()
    assert failed(report) == {}
    assert report.summary["encoding"] == "preencoded"
    assert report.summary["samples"] == 6 and report.summary["shards"] == 3
    assert {split: v["loaded"] for split, v in report.summary["splits"].items()} == {"train": 2, "val": 2, "test": 2}
    assert report.summary["fields"]["latents"] == {"shapes": {"16x4x4": 6}, "dtypes": {"bfloat16": 6}}
    assert report.summary["bytes"] == sum((out / contract.shard_name(u)).stat().st_size for u in range(3))
    assert ("shards", 3, 3) in progress and ("load train", 2, 2) in progress

    saved = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert saved["ok"] is True and len(saved["checks"]) == len(report.checks)
    assert "Validation passed" in report.to_markdown()

    stats = torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)
    latents = torch.stack([fields[contract.LATENTS] for fields in written.values()]).to(torch.float64)
    channels = latents.transpose(0, 1).reshape(16, -1)
    assert close32(stats["mean"], channels.mean(dim=1)) and close32(stats["std"], channels.std(dim=1, correction=0))
    assert int(stats["samples"]) == 6 and int(stats["count"]) == 6 * 16

    drawn = validate_dataset(out)  # by default: one sample drawn from each shard, every shard's headers read
    assert drawn.ok, drawn.to_markdown()
    assert {split: v["loaded"] for split, v in drawn.summary["splits"].items()} == {"train": 1, "val": 1, "test": 1}
    assert drawn.summary["loaded"] == {"samples": 3, "how": "one drawn from each shard (--full: every sample)"}
    assert "| loaded | 3 samples: one drawn from each shard (--full: every sample) |" in drawn.to_markdown()


def test_expected_shapes_from_argument_and_plan(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    good = {"latents": [16, 4, 4], "prompt_embeds": [8, 32], "pooled_prompt_embeds": [16], "dtype": "bfloat16"}
    assert validate_dataset(out, expected=good).ok
    assert validate_dataset(out, expected=good | {"latents": None}).ok  # variable size

    report = validate_dataset(out, expected=good | {"prompt_embeds": [512, 32]})
    assert list(failed(report)) == ["shapes and dtypes"]
    assert "_000000 prompt_embeds has shape 8x32, expected 512x32" in failed(report)["shapes and dtypes"]

    (out / contract.STATE_DIR / contract.PLAN_JSON).write_text(json.dumps({"expected": good | {"dtype": "float16"}}))
    report = validate_dataset(out)
    assert "latents has dtype bfloat16, expected float16" in failed(report)["shapes and dtypes"]
    assert report.summary["expected"]["source"] == "plan"

    with pytest.raises(ConfigError, match="unknown keys \\['latent'\\]"):
        validate_dataset(out, expected={"latent": [16, 4, 4]})


def test_inconsistent_shapes_without_a_plan_fail(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_unit(out, 0, overrides={1: {contract.POOLED_PROMPT_EMBEDS: torch.zeros(8, dtype=torch.bfloat16)}})
    write_unit(out, 1, overrides={0: {contract.LATENTS: torch.zeros(16, 6, 2, dtype=torch.bfloat16)}})
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    report = validate_dataset(out, full=True)  # the first sample's shapes are the expected ones: every one loaded
    # Latent height and width may vary; the pooled embedding may not.
    assert list(failed(report)) == ["shapes and dtypes"]
    assert "000000_000001 pooled_prompt_embeds has shape 8, expected 16" in failed(report)["shapes and dtypes"]
    assert report.summary["fields"]["latents"]["shapes"] == {"16x4x4": 3, "16x6x2": 1}


@pytest.mark.parametrize("how", ["flip_byte", "truncate"])
def test_corrupted_shard_fails(tmp_path: Path, how: str) -> None:
    out, _ = make_dataset(tmp_path)
    shard = out / "000001.tar"
    data = bytearray(shard.read_bytes())
    if how == "flip_byte":
        # A changed caption byte: every sample still loads, only the manifest's sha256 can tell.
        data[data.index(b"caption ") + 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))

    report = validate_dataset(out)
    assert not report.ok
    problems = failed(report)
    assert "000001.tar is" in problems["manifests"] and "modified or corrupted" in problems["manifests"]
    if how == "truncate":
        assert "000001.tar: cannot read the tar headers (unexpected end of data)" in problems["shard counts"]
        # Its samples past the cut do not load (the default loads only the drawn one, here before the cut).
        assert any(name.startswith("load ") for name in failed(validate_dataset(out, full=True))), problems
    assert not (out / contract.STATE_DIR / contract.LATENT_STATS).exists()
    assert json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())["ok"] is False


def test_missing_tar_index_fails(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    (out / "000002.tar.idx").unlink()
    report = validate_dataset(out)
    assert "000002.tar.idx is missing" in failed(report)["shard files"]


def test_count_mismatch_with_info_json_fails(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    info_path = out / contract.NV_META / contract.INFO_JSON
    info = json.loads(info_path.read_text())
    info["shard_counts"]["000000.tar"] = 3
    info_path.write_text(json.dumps(info))
    report = validate_dataset(out)
    problems = failed(report)
    assert "000000.tar holds 2 samples, .info.json counts 3" in problems["shard counts"]
    assert "index.sqlite holds 6 samples, .info.json counts 7" in problems["metadata"]


def test_nan_fails(tmp_path: Path) -> None:
    out = tmp_path / "out"
    latents = torch.zeros(16, 4, 4, dtype=torch.bfloat16)
    latents[3, 1, 2] = float("nan")
    write_unit(out, 0, overrides={1: {contract.LATENTS: latents}})
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    report = validate_dataset(out)
    assert failed(report) == {"finite values": "000000_000001 latents has 1 NaN/Inf values"}
    with pytest.raises(DatasetValidationError, match="finite values"):
        report.raise_if_failed()


def test_pickle_bomb_is_refused_not_executed(tmp_path: Path) -> None:
    # The payload is real: an unrestricted load runs it.
    proof = tmp_path / "proof"
    torch.load(__import__("io").BytesIO(pickle_bomb_pth(proof)), weights_only=False)
    assert proof.is_dir()

    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    write_unit(out, 0, overrides={1: {contract.PROMPT_EMBEDS: pickle_bomb_pth(marker)}})
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    report = validate_dataset(out)
    assert not marker.exists()
    detail = failed(report)["load train"]
    assert "sample '000000_000001' field 'prompt_embeds.pth' is not a plain tensor file" in detail
    assert "unsupported GLOBAL posix.mkdir" in detail and "In PyTorch 2.6" not in detail


def test_max_load_limits_loading_not_counting(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path, units=3, samples=3)
    report = validate_dataset(out, max_load=2)
    assert report.ok, report.to_markdown()
    assert {split: v["loaded"] for split, v in report.summary["splits"].items()} == {"train": 2, "val": 2, "test": 2}
    assert int(torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)["samples"]) == 6
    with pytest.raises(ConfigError, match="max_load must be >= 1"):
        validate_dataset(out, max_load=0)


def test_unfinalized_append_and_missing_metadata_fail(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    write_unit(out, 3)
    assert "000003.tar is committed but not in the dataset; run finalize" in failed(validate_dataset(out))["splits"]

    (out / contract.NV_META / contract.SPLIT_YAML).unlink()
    assert "split.yaml is missing" in failed(validate_dataset(out))["metadata"]
    assert not validate_dataset(tmp_path / "nowhere").ok


def test_encoding_mismatch_fails(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    report = validate_dataset(out, encoding=contract.ENCODING_RAW)
    assert "declares encoding 'preencoded', validation asked for 'raw'" in failed(report)["metadata"]


def test_raw_dataset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_raw_unit(out, 0, [png_bytes((255, 0, 0)), png_bytes((0, 255, 0))])
    write_raw_unit(out, 1, [b"not an image"])
    finalize(out, encoding=contract.ENCODING_RAW, train_split=1.0)
    report = validate_dataset(out, full=True)  # the image count below is of every sample
    assert list(failed(report)) == ["images"]
    assert "000001_000000 png does not decode" in failed(report)["images"]
    assert report.summary["images"] == {"PNG RGB": 2}
    assert not (out / contract.STATE_DIR / contract.LATENT_STATS).exists()

    # A raw plan names the fields each sample must have.
    (out / contract.STATE_DIR / contract.PLAN_JSON).write_text(
        json.dumps({"expected": {"fields": ["png", "txt", "json"]}}))
    detail = failed(validate_dataset(out))["fields"]
    assert "000000.tar sample 000000_000000: missing ['json'] (required by the plan)" in detail


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "diffprep.validation", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    good = run_cli(str(out))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "# Validation passed" in good.stdout

    (out / "000000.tar.idx").unlink()
    bad = run_cli(str(out), "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    assert [c["name"] for c in report["checks"] if not c["ok"]][0] == "shard files"

    assert run_cli(str(out), "--max-load", "0").returncode == 2
    from diffprep.validation import main

    assert main([str(out), "--full", "--max-load", "1"]) == 2  # one or the other
    assert main([str(out), "--workers", "2"]) == 2  # processes that load every sample: with --full only


def test_a_bad_sample_is_found_when_drawn_and_always_by_full_in_one_process_or_two(tmp_path: Path) -> None:
    from diffprep.validation.loading import drawn_index

    out = tmp_path / "out"
    drawn = [drawn_index(contract.shard_name(unit), 4) for unit in (0, 1)]
    missed = (drawn[0] + 1) % 4  # a sample of shard 0 that the default does not load

    def nan_latents() -> torch.Tensor:
        latents = torch.zeros(16, 4, 4, dtype=torch.bfloat16)
        latents[0, 0, 0] = float("nan")
        return latents

    write_unit(out, 0, 4, overrides={missed: {contract.LATENTS: nan_latents()}})
    write_unit(out, 1, 4, overrides={drawn[1]: {contract.LATENTS: nan_latents()}})
    write_unit(out, 2, 4)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)

    default = validate_dataset(out, previews=0)
    assert failed(default) == {"finite values": f"000001_{drawn[1]:06d} latents has 1 NaN/Inf values"}
    assert default.summary["loaded"]["samples"] == 3

    full = validate_dataset(out, previews=0, full=True)
    assert failed(full) == {"finite values": f"000000_{missed:06d} latents has 1 NaN/Inf values\n"
                                             f"000001_{drawn[1]:06d} latents has 1 NaN/Inf values"}
    assert full.summary["loaded"]["samples"] == 12
    # Read by two processes, inspected here in the one-process loader's order: the same report.
    assert validate_dataset(out, previews=0, full=True, workers=2).to_json() == full.to_json()


def test_the_validate_flow_loads_one_sample_per_shard_or_every_one_with_full(prefect_server, tmp_path: Path) -> None:
    from diffprep.flows.validate import validate_dataset_flow

    out, _ = make_dataset(tmp_path)
    assert validate_dataset_flow(str(out))["summary"]["loaded"] == {
        "samples": 3, "how": "one drawn from each shard (--full: every sample)"}
    full = validate_dataset_flow(str(out), full=True)
    assert full["ok"] and full["summary"]["loaded"] == {"samples": 6, "how": "every sample, through Energon's loader"}
