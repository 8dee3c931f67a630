"""Split assignment, finalize (Energon's metadata: tests/test_energon_index.py), and loading with diffprep's cookers."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from megatron.energon import WorkerConfig, get_loader, get_train_dataset
from megatron.energon.errors import reraise_exception
from PIL import Image

from diffprep import contract
from diffprep.writer.cooker import FluxPreencodedSample, FluxPreencodedTaskEncoder, FluxRawTaskEncoder
from diffprep.run.energon import (
    assign_splits,
    finalize,
    planned_split,
    preview_replace_split,
    read_assignment,
    read_split_yaml,
)
from diffprep.errors import ConfigError, DatasetValidationError, ExistingOutputError
from diffprep.writer.shards import ShardWriter, UnitManifest, file_sha256, write_manifest


def preencoded_sample(generator: torch.Generator, latents_shape: tuple[int, ...] = (16, 4, 4)) -> dict[str, Any]:
    return {
        contract.LATENTS: torch.randn(latents_shape, generator=generator).to(torch.bfloat16),
        contract.PROMPT_EMBEDS: torch.randn(8, 32, generator=generator).to(torch.bfloat16),
        contract.POOLED_PROMPT_EMBEDS: torch.randn(16, generator=generator).to(torch.bfloat16),
        contract.CAPTION: f"caption {torch.randint(0, 1000, (1,), generator=generator).item()}",
        contract.META: {"source_id": "x", "original_size": [32, 32]},
    }


def write_unit(
    out: Path,
    unit: int,
    samples: int = 2,
    *,
    overrides: dict[int, dict[str, Any]] | None = None,
    commit_manifest: bool = True,
) -> dict[str, dict[str, Any]]:
    """Write one committed unit (shard, then manifest) of random pre-encoded samples; returns key -> fields.

    ``overrides`` replaces fields of the sample at an index (e.g. a NaN latent).
    """
    generator = torch.Generator().manual_seed(unit)
    written = {}
    with ShardWriter(out, unit) as writer:
        for index in range(samples):
            fields = preencoded_sample(generator) | (overrides or {}).get(index, {})
            key = contract.sample_key(unit, index)
            writer.write(key, fields)
            written[key] = fields
        keys = writer.keys
        info = writer.commit()
    if commit_manifest:
        write_manifest(out, UnitManifest(
            unit=unit, shard=info.name, fingerprint="test", keys=keys, source_ids=keys,
            count=info.count, bytes=info.bytes, sha256=info.sha256,
        ))
    return written


def write_units(out: Path, units: range, samples: int = 2) -> dict[str, dict[str, Any]]:
    written = {}
    for unit in units:
        written |= write_unit(out, unit, samples)
    return written


def png_bytes(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_raw_unit(out: Path, unit: int, images: list[bytes]) -> None:
    with ShardWriter(out, unit) as writer:
        for index, image in enumerate(images):
            writer.write(contract.sample_key(unit, index), {"png": image, "txt": f"caption {unit} {index}"})
        keys = writer.keys
        info = writer.commit()
    write_manifest(out, UnitManifest(
        unit=unit, shard=info.name, fingerprint="test", keys=keys, source_ids=keys,
        count=info.count, bytes=info.bytes, sha256=info.sha256,
    ))


def worker_config() -> WorkerConfig:
    return WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)


def names(count: int, start: int = 0) -> list[str]:
    return [contract.shard_name(unit) for unit in range(start, start + count)]


# -- assign_splits ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("shards", "train_split", "expected"),
    [
        (3, 0.8, {"train": 1, "val": 1, "test": 1}),
        (4, 0.5, {"train": 2, "val": 1, "test": 1}),
        (10, 0.8, {"train": 8, "val": 1, "test": 1}),
        (20, 0.8, {"train": 16, "val": 2, "test": 2}),
        (100, 0.9, {"train": 90, "val": 5, "test": 5}),
        (1, 1.0, {"train": 1}),
        (7, 1.0, {"train": 7}),
    ],
)
def test_assign_splits_ratios(shards: int, train_split: float, expected: dict[str, int]) -> None:
    assignment = assign_splits(names(shards), {}, train_split, seed=42)
    assert sorted(assignment) == names(shards)
    assert Counter(assignment.values()) == expected


def test_assign_splits_is_deterministic_and_seeded() -> None:
    first = assign_splits(names(30), {}, 0.8, seed=1)
    assert assign_splits(list(reversed(names(30))), {}, 0.8, seed=1) == first
    held_out = {seed: {s for s, p in assign_splits(names(30), {}, 0.8, seed=seed).items() if p != "train"}
                for seed in range(5)}
    # The seed picks which shards are held out, not only the last ones in name order.
    assert len({frozenset(v) for v in held_out.values()}) > 1
    assert all(v != set(names(30)[-6:]) for v in held_out.values())


def test_assign_splits_never_moves_existing_shards() -> None:
    existing = assign_splits(names(10), {}, 0.8, seed=42)
    grown = assign_splits(names(15), existing, 0.8, seed=42)
    assert {s: grown[s] for s in existing} == existing
    assert Counter(grown.values()) == {"train": 12, "val": 2, "test": 1}

    # A changed ratio applies to new shards only.
    regrown = assign_splits(names(15), existing, 0.4, seed=42)
    assert {s: regrown[s] for s in existing} == existing
    assert Counter(regrown[s] for s in names(5, start=10)) == {"val": 3, "test": 2}

    # Shards that are gone are dropped from the result.
    assert set(assign_splits(names(5, start=3), existing, 0.8, seed=42)) == set(names(5, start=3))


def test_assign_splits_train_only_keeps_existing_held_out_shards() -> None:
    existing = {"000000.tar": "val", "000001.tar": "train"}
    assignment = assign_splits(names(4), existing, 1.0, seed=0)
    assert assignment == {"000000.tar": "val", "000001.tar": "train", "000002.tar": "train", "000003.tar": "train"}


@pytest.mark.parametrize("shards", [1, 2])
def test_assign_splits_too_few_shards(shards: int) -> None:
    with pytest.raises(ConfigError) as error:
        assign_splits(names(shards), {}, 0.8, seed=42)
    message = str(error.value)
    assert f"{shards} shard(s)" in message and "--shard-size" in message and "--train-split 1.0" in message


@pytest.mark.parametrize("train_split", [0.0, -0.1, 1.5])
def test_assign_splits_rejects_bad_ratio(train_split: float) -> None:
    with pytest.raises(ConfigError, match="train_split must be in"):
        assign_splits(names(10), {}, train_split, seed=42)


def test_assign_splits_rejects_unknown_recorded_split() -> None:
    with pytest.raises(ConfigError, match="'validation'"):
        assign_splits(names(3), {"000000.tar": "validation"}, 0.8, seed=42)


# -- finalize -----------------------------------------------------------------------------------

def test_finalize_then_append(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_units(out, range(10))
    (out / "foreign.tar").write_bytes(b"not ours")
    write_unit(out, 99, commit_manifest=False)  # an interrupted unit: tar without manifest

    result = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)

    assert {split: len(shards) for split, shards in result.splits.items()} == {"train": 8, "val": 1, "test": 1}
    assert result.counts == {"train": 16, "val": 2, "test": 2}
    assert result.changed and result.new_shards == names(10) and result.moved == {}
    assert result.foreign == ["000099.tar", "foreign.tar"]
    assert set(contract.PREENCODED_FIELDS) <= set(result.parts)
    meta = out / contract.NV_META
    for name in (contract.DATASET_YAML, contract.SPLIT_YAML, contract.INFO_JSON, contract.INDEX_SQLITE):
        assert (meta / name).is_file(), name
    assert yaml.safe_load((meta / contract.DATASET_YAML).read_text()) == {
        "__module__": "megatron.energon", "__class__": "CrudeWebdataset", "subflavors": {"encoding": "preencoded"},
    }
    info = json.loads((meta / contract.INFO_JSON).read_text())
    assert info["shard_counts"] == {name: 2 for name in names(10)}
    assert all((out / name.replace(".tar", ".tar.idx")).is_file() for name in names(10))
    assert not (out / "000099.tar.idx").exists()
    first = read_assignment(out)
    assert first == {s: split for split, shards in result.splits.items() for s in shards}
    recorded = json.loads((out / contract.STATE_DIR / contract.SPLITS_JSON).read_text())
    assert recorded["assignment"] == first and recorded["train_split"] == 0.8

    # Nothing new: same assignment, nothing changed.
    again = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)
    assert not again.changed and again.splits == result.splits

    # Append five units (99 is now committed too) and finalize again: old shards stay where they were.
    write_units(out, range(10, 15))
    size, sha256 = file_sha256(out / "000099.tar")
    keys = ["000099_000000", "000099_000001"]
    write_manifest(out, UnitManifest(
        unit=99, shard="000099.tar", fingerprint="test", keys=keys, source_ids=keys, count=2, bytes=size, sha256=sha256,
    ))
    appended = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)
    second = read_assignment(out)
    assert {s: second[s] for s in first} == first
    assert appended.new_shards == names(5, start=10) + ["000099.tar"]
    assert appended.changed and appended.moved == {} and appended.foreign == ["foreign.tar"]
    assert sum(appended.counts.values()) == 32
    info = json.loads((meta / contract.INFO_JSON).read_text())
    assert sorted(info["shard_counts"]) == sorted(names(15) + ["000099.tar"])
    assert read_split_yaml(out) == second


def test_finalize_reads_assignment_of_an_earlier_prepare(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_units(out, range(6))
    first = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.5, seed=3)
    (out / contract.STATE_DIR / contract.SPLITS_JSON).unlink()
    # Same shards under another ratio and seed: only split.yaml can keep the old assignment.
    again = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.9, seed=4)
    assert again.splits == first.splits and not again.changed


def test_finalize_replace_split_moves_only_with_consent(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_units(out, range(10), samples=1)
    kept = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)

    unchanged = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.4)
    assert unchanged.splits == kept.splits and not unchanged.changed

    preview = preview_replace_split(out, train_split=0.4)
    assert preview, "a new ratio must move some shards"
    replaced = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.4, replace_split=True)
    assert replaced.moved == preview and replaced.changed
    assert {split: len(shards) for split, shards in replaced.splits.items()} == {"train": 4, "val": 3, "test": 3}


def test_finalize_refuses_conflicts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_units(out, range(3))
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)
    with pytest.raises(ExistingOutputError, match="declares encoding 'preencoded'"):
        finalize(out, encoding=contract.ENCODING_RAW, train_split=0.8)

    # A shard that has a split but is gone: the dataset would silently shrink.
    assignment = read_assignment(out)
    gone = next(s for s, split in assignment.items() if split == "val")
    (out / gone).unlink()
    (out / contract.STATE_DIR / contract.UNITS_DIR / gone.replace(".tar", ".json")).unlink()
    with pytest.raises(DatasetValidationError, match=f"no longer committed: \\['{gone}'\\]"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8)

    with pytest.raises(ConfigError, match="cannot fill"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.8, replace_split=True)


def test_finalize_refuses_a_shard_changed_after_commit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_units(out, range(3))
    with open(out / "000001.tar", "ab") as handle:
        handle.write(b"\0" * 512)
    with pytest.raises(DatasetValidationError, match="000001.tar is .* bytes but its manifest records"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)


def test_finalize_without_committed_shards(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_unit(out, 0, commit_manifest=False)
    with pytest.raises(DatasetValidationError, match="no committed shards"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)


# -- loading with the cookers --------------------------------------------------------------------

def test_preencoded_dataset_loads_through_get_train_dataset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = write_units(out, range(3), samples=3)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)

    dataset = get_train_dataset(
        out, batch_size=2, shuffle_buffer_size=None, max_samples_per_sequence=None,
        task_encoder=FluxPreencodedTaskEncoder(), worker_config=worker_config(), repeat=False,
    )
    seen = set()
    for batch in get_loader(dataset, watchdog_timeout_seconds=None):
        assert batch.latents.shape[1:] == (16, 4, 4) and batch.latents.dtype == torch.bfloat16
        for i, key in enumerate(batch.__key__):
            fields = written[key]
            assert torch.equal(batch.latents[i], fields[contract.LATENTS])
            assert torch.equal(batch.prompt_embeds[i], fields[contract.PROMPT_EMBEDS])
            assert torch.equal(batch.pooled_prompt_embeds[i], fields[contract.POOLED_PROMPT_EMBEDS])
            assert batch.caption[i] == fields[contract.CAPTION]
            assert batch.meta[i] == fields[contract.META]
            seen.add(key)
    assert seen == set(written)


def test_batching_refuses_mixed_latent_sizes() -> None:
    samples = [
        FluxPreencodedSample(
            __key__=f"k{i}", __restore_key__=(), latents=torch.zeros(16, size, size), prompt_embeds=torch.zeros(8, 32),
            pooled_prompt_embeds=torch.zeros(16), caption="", meta={},
        )
        for i, size in enumerate((4, 6))
    ]
    with pytest.raises(ValueError, match="cannot batch latents of different shapes"):
        FluxPreencodedTaskEncoder().batch(samples)


def test_raw_dataset_loads_with_the_raw_cooker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    images = {unit: png_bytes((unit * 40, 0, 0)) for unit in range(3)}
    for unit, image in images.items():
        write_raw_unit(out, unit, [image])
    finalize(out, encoding=contract.ENCODING_RAW, train_split=0.8)

    loaded = {}
    for split in ("train", "val", "test"):
        dataset = get_train_dataset(
            out, split_part=split, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
            task_encoder=FluxRawTaskEncoder(), worker_config=worker_config(), repeat=False,
        )
        for sample in get_loader(dataset, watchdog_timeout_seconds=None):
            loaded[sample.__key__] = sample
    assert {key: s.image for key, s in loaded.items()} == {contract.sample_key(u, 0): img for u, img in images.items()}
    assert all(s.image_format == "png" and s.caption.startswith("caption") for s in loaded.values())

    # A pre-encoded task encoder has no cooker for raw samples.
    with pytest.raises(ValueError, match="No cooker found for subflavors: {'encoding': 'raw'}"):
        get_train_dataset(
            out, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
            task_encoder=FluxPreencodedTaskEncoder(), worker_config=worker_config(), repeat=False,
        )


# The split asked for, checked against the planned shards before anything is written


def test_planned_split_says_what_whole_shards_give() -> None:
    assert planned_split(10, 0.8) == ({"train": 8, "val": 1, "test": 1}, None)
    counts, warning = planned_split(3, 0.8)
    assert counts == {"train": 1, "val": 1, "test": 1}
    assert warning == ("--train-split 0.8 over 3 shards gives train 1 / val 1 / test 1 shards (splits are by whole "
                       "shard): lower --shard-size for a split closer to 0.8")
    with pytest.raises(ConfigError, match="1 shard\\(s\\) cannot fill the 3 splits"):
        planned_split(1, 0.8)


@pytest.mark.slow
def test_a_split_is_checked_before_encoding_and_kept_for_a_later_finalize(tmp_path, tiny_model, settings_for,
                                                                          caplog) -> None:
    from diffprep.cli import main
    from diffprep.tools.demo import write_demo_dataset
    from diffprep.phases.pipeline import run

    images = write_demo_dataset(tmp_path / "images", samples=6)
    out = tmp_path / "out"

    def never_ask(question, preset=None, *, release=False):
        pytest.fail(f"asked {question.key}")

    # One shard cannot be split 0.8: refused before the output exists, not after the whole encode.
    one_shard = settings_for(out, images, tiny_model, output={"shard_size": 8}, finalize={"train_split": 0.8})
    with pytest.raises(ConfigError, match="cannot fill the 3 splits"):
        run(one_shard, "preencoded", ask=never_ask)
    assert not out.exists()

    # Three shards at 0.8 are 1 / 1 / 1: said before encoding. Not finalized now, the later finalize keeps 0.8.
    settings = settings_for(out, images, tiny_model, output={"shard_size": 2},
                            finalize={"train_split": 0.8, "enabled": False})
    with caplog.at_level("WARNING", logger="diffprep.pipeline"):
        run(settings, "preencoded", ask=never_ask)
    assert "--train-split 0.8 over 3 shards gives train 1 / val 1 / test 1 shards" in caplog.text
    assert json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())["split"] == {
        "train_split": 0.8, "seed": 42}
    assert main(["finalize", str(out)]) == 0
    assert json.loads((out / contract.STATE_DIR / contract.SPLITS_JSON).read_text())["train_split"] == 0.8
    assert sorted(set(read_split_yaml(out).values())) == ["test", "train", "val"]
