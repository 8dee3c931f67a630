"""Text encodings computed once per distinct caption (``diffprep/families/text_cache.py``), through a whole run.

A class-label dataset (an HF ``ClassLabel`` captioned through ``--caption-template``) whose captions repeat
inside batches, across batches and across units is encoded twice, with the cache and without it: the text
encoders see each distinct caption once with it, and every output byte is the same.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from PIL import Image

from diffprep import contract
from diffprep.families.text_cache import TEXT_BATCH
from diffprep.encodings import preencoded
from diffprep.encodings.preencoded import load_encoders
from diffprep.phases.pipeline import run

NAMES = ["tench", "goldfish", "great white shark", "tiger shark"]
# 3 units of 4 samples, one batch each (shard_size 4, batch_size 4): captions repeat inside a batch, across
# batches and units; class 3 first appears in unit 1.
LABELS = [0, 1, 0, 2, 1, 1, 0, 3, 2, 0, 3, 1]
# The run's own files that differ between two runs of the same settings (timings, free space, Energon's index id).
VOLATILE = {f"{contract.STATE_DIR}/sanity/report.json"}


def class_label_dataset(path: Path) -> Path:
    images = [Image.new("RGB", (40, 32), (20 * i, 100, 200 - 10 * i)) for i in range(len(LABELS))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    datasets.Dataset.from_dict({"image": images, "label": LABELS}, features=features).save_to_disk(str(path))
    return path


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and str(p.relative_to(root)) not in VOLATILE and not contract.is_lock_file(p.name)}


def test_each_distinct_caption_is_encoded_once_and_the_bytes_equal_a_run_without_the_cache(
    tmp_path, tiny_model, settings_for, monkeypatch
) -> None:
    data = class_label_dataset(tmp_path / "imagenet-like")
    runs = {}
    for name, model in (("cached", {}), ("uncached", {"text_cache_mib": 0})):
        monkeypatch.setattr(preencoded, "_LOADED", {})  # a fresh encoder set, and so a fresh cache, per run
        settings = settings_for(tmp_path / name, data, tiny_model, model=model, finalize={"enabled": False},
                                source={"type": "huggingface", "hf_dataset": str(data), "input_dir": None,
                                        "caption_template": "a photo of a {label}"})
        encoders = load_encoders(settings)  # the set the run loads (once per process)
        forwards: list[int] = []
        hook = encoders.t5_text.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape[0]))
        try:
            result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
        finally:
            hook.remove()
        assert result.samples == 12 and result.rejected == 0
        runs[name] = (files(tmp_path / name), result.fingerprint, encoders.text_cache.stats, forwards)
        # The rows shared with the run's other processes lived in the working folder while the units ran; the run
        # removed them once they were done (the dataset never holds them).
        assert (encoders.text_cache.folder is not None) == (name == "cached")
        assert not (tmp_path / name / contract.STATE_DIR / contract.TEXT_CACHE_DIR).exists()

    cached, uncached = runs["cached"], runs["uncached"]
    # The empty caption (CFG files), the sanity batch, then 3 units: 4 class captions and "" are 5 distinct
    # captions, encoded once each, in 3 calls: "", the sanity batch's 3, unit 1's new class.
    stats = cached[2]
    assert (stats.encoded, stats.calls, stats.captions) == (len(set(LABELS)) + 1, 3, 1 + 4 + len(LABELS))
    assert stats.hits == 11  # unit 0: 4 of the sanity batch's, unit 1: 3, unit 2: 4
    # Without the cache each call encodes its own distinct captions: 1 + 3 + (3 + 3 + 4).
    assert (uncached[2].encoded, uncached[2].calls, uncached[2].hits) == (14, 5, 0)
    # One T5 forward pass per call, always TEXT_BATCH captions long (the rest empty captions).
    assert cached[3] == [TEXT_BATCH] * 3 and uncached[3] == [TEXT_BATCH] * 5

    # The cache changes nothing written: the same fingerprint and every file byte for byte.
    assert cached[1] == uncached[1]
    assert sorted(cached[0]) == sorted(uncached[0])
    assert [name for name in cached[0] if cached[0][name] != uncached[0][name]] == []
    shards = [name for name in cached[0] if name.endswith(contract.SHARD_SUFFIX)]
    assert len(shards) == 3
    import tarfile

    with tarfile.open(tmp_path / "cached" / shards[1]) as tar:
        captions = [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith(contract.CAPTION)]
    assert captions == [f"a photo of a {NAMES[label]}" for label in LABELS[4:8]]


def test_processes_of_a_run_share_their_rows_through_a_folder(tmp_path) -> None:
    """Two caches over one folder stand for two encoding processes of a run (process-pool workers, ranks): a
    caption one of them encoded is read by the other, bit for bit, not encoded again."""
    import torch

    from diffprep.families.text_cache import TextCache

    encoded: list[str] = []

    def encode(captions: list[str]) -> list[tuple]:
        encoded.extend(captions)
        return [(torch.randn(3, 4, dtype=torch.bfloat16), torch.tensor([len(c)]), len(c) > 5) for c in captions]

    folder = tmp_path / "text_cache" / "fingerprint" / "host"
    first, second, alone = TextCache(1 << 20), TextCache(1 << 20), TextCache(1 << 20)
    first.share(folder)
    second.share(folder)
    rows = first.rows(["a cat", "a dog", "a cat"], encode)
    assert encoded == ["a cat", "a dog"] and len(list(folder.glob("*.pt"))) == 2
    again = second.rows(["a dog", "a bird", "a cat"], encode)
    assert encoded == ["a cat", "a dog", "a bird"]  # only the caption no process had encoded
    assert second.stats.shared == 2 and second.stats.hits == 2 and second.stats.encoded == 1
    assert torch.equal(again[0][0], rows[1][0]) and torch.equal(again[2][0], rows[0][0]) and again[0][2] == rows[1][2]
    assert alone.rows(["a cat"], encode) and encoded[-1] == "a cat"  # a process not sharing encodes for itself

    # A damaged file is encoded again (and replaced); a cache that is off shares nothing.
    next(iter(folder.glob("*.pt"))).write_bytes(b"not a row")
    third = TextCache(1 << 20)
    third.share(folder)
    third.rows(["a cat", "a dog", "a bird"], encode)
    assert third.stats.encoded == 1 and third.stats.shared == 2
    off = TextCache(0)
    off.share(folder)
    assert off.folder is None


def test_a_cache_whose_captions_do_not_repeat_lets_its_rows_go() -> None:
    """Distinct captions: after the probe, nothing is kept (memory flat as a dataset grows); repeats: all kept."""
    import torch

    from diffprep.families.text_cache import PROBE_CAPTIONS, TextCache

    def encode(captions: list[str]) -> list[tuple]:
        return [(torch.zeros(64), len(c) > 5) for c in captions]

    distinct = TextCache(1 << 30)
    for start in range(0, 2 * PROBE_CAPTIONS, 8):
        distinct.rows([f"caption {i}" for i in range(start, start + 8)], encode)
    assert not distinct.stats.kept and len(distinct) == 0 and distinct.bytes == 0
    distinct.rows(["caption 0"], encode)
    assert len(distinct) == 0 and distinct.stats.encoded == 2 * PROBE_CAPTIONS + 1
    distinct.share("/nonexistent/shared")  # the next unit shares again: a cache that stopped keeping stays off
    assert distinct.folder is None

    classes = TextCache(1 << 30)
    for start in range(0, 2 * PROBE_CAPTIONS, 8):
        classes.rows([f"a photo of class {i % 10}" for i in range(start, start + 8)], encode)
    assert classes.stats.kept and len(classes) == 10 and classes.stats.encoded == 10
