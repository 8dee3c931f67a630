"""Prompt-only shards (`diffprep raw --prompts-only`): captions without media, as FastGen's PromptLoaderConfig
reads them through webdataset; shard_counts.json under --layout fastgen; rejects named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from diffprep.config import load_settings
from diffprep.encodings import encoding_for, get_encoding
from diffprep.errors import ConfigError
from diffprep.phases.pipeline import run
from diffprep.validation import validate_dataset
from flow_runs import shard_samples


def test_prompt_shards_hold_captions_only_and_load_as_fastgen_reads_them(tmp_path: Path):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "captions").mkdir()
    captions = {"a": "  a red square \n", "b": "a blue circle", "c": "", "d": None, "e": "a green line"}
    for name, caption in captions.items():
        # "not an image" is never decoded: a prompts run reads captions only.
        (data / "images" / f"{name}.png").write_bytes(b"not an image" if name == "e" else b"")
        if name != "e":
            Image.new("RGB", (8, 8), (10, 20, 30)).save(data / "images" / f"{name}.png")
        if caption is not None:
            (data / "captions" / f"{name}.txt").write_text(caption, encoding="utf-8")
    out = tmp_path / "out"
    settings = load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 2, "accept_rejects": 0.5, "layout": "fastgen"},
        "raw": {"prompts_only": True}, "finalize": {"train_split": 1.0}})
    assert encoding_for(settings, "raw") == "prompts"
    result = run(settings, "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 4 and result.rejected == 1 and result.validation["ok"], result.validation
    # Counted over the loaded samples: --full loads every one (the run's own validation one per shard).
    assert validate_dataset(out, previews=0, full=True).summary["empty_captions"] == 1
    stored = shard_samples(out)
    assert all(sorted(fields) == ["json", "txt"] for fields in stored.values())
    assert {json.loads(f["json"])["source_id"]: f["txt"].decode() for f in stored.values()} == {
        "a.png": "a red square", "b.png": "a blue circle", "c.png": "", "e.png": "a green line"}

    # FastGen's loader: webdataset over the datatag's tars, txt decoded and stripped; shard_count_file beside them.
    import webdataset as wds

    tars = sorted(out.glob("*.tar"))
    counts = json.loads((out / "shard_counts.json").read_text())
    assert counts == {tar.name: sum(1 for k in stored if k.startswith(tar.stem + "_")) for tar in tars}
    read = [sample["txt"].strip() for sample in wds.WebDataset([str(t) for t in tars], shardshuffle=False).decode()]
    assert sorted(read) == sorted(["a red square", "a blue circle", "", "a green line"])
    assert sum(counts.values()) == len(read) and all(counts.values())

    with pytest.raises(ConfigError, match="--prompts-only stores captions alone"):
        get_encoding("prompts").plan_settings(load_settings(overrides={
            "raw": {"prompts_only": True}, "video": {"resolution_buckets": "32x32x5"}}), None)
