"""``diffprep ignore-list`` and the unit whose every sample is rejected.

The scan: a dataset with planted broken samples (a truncated member, a missing member, a NaN latent, a shard cut
short) gives exactly those keys, by shard, each with its reason, and writes FastGen's ``{"<shard>.tar": [keys]}``
beside the tars without touching a shard. Its effect on a count is FastGen's (``wds_utils.get_shard_count``
subtracts each shard's listed keys from ``shard_counts.json``): the counts stay as written.

The all-rejected unit (the demo set, one unit's images unreadable): no tar, no entry in ``shard_counts.json``, its
manifest names no shard and holds the rejects; audit counts them, validation passes, a re-run does not redo it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest
import torch
import webdataset.autodecode
from fastgen_loader import fastgen_ignore_index, fastgen_samples, fastgen_shard_counts, fastgen_shards

from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.cli import main
from diffprep.run.energon import finalize
from diffprep.writer.layouts import Layout
from diffprep.output import as_output
from diffprep.phases.pipeline import run
from diffprep.writer.plan import read_plan, write_plan
from diffprep.writer.shards import read_manifests, torch_bytes
from diffprep.validation.ignore_list import scan_output


def _rewrite(shard, change) -> None:
    """Rewrite a tar member by member: ``change(name, data)`` -> new bytes, or None to drop the member."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in members:
            data = change(member.name, data)
            if data is not None:
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def _digests(out) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def test_scan_names_exactly_the_planted_keys(tmp_path, make_plan, write_unit, capsys) -> None:
    out = tmp_path / "out"
    plan = make_plan((4, 4, 4))
    write_plan(out, plan)
    for unit in range(3):
        write_unit(out, plan, unit)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    latents, embeds = contract.LATENTS, contract.PROMPT_EMBEDS
    nan = torch.full(plan.expected["latents"], float("nan"))
    # 000000.tar: one latent cut in half, one sample without its T5 embedding; 000001.tar: a NaN latent, and a
    # latent of another shape; 000002.tar: cut short inside its third sample.
    _rewrite(out / "000000.tar", lambda name, data: data[: len(data) // 2] if name == f"000000_000001.{latents}"
             else None if name == f"000000_000002.{embeds}" else data)
    _rewrite(out / "000001.tar", lambda name, data: torch_bytes(nan) if name == f"000001_000000.{latents}"
             else torch_bytes(torch.zeros(16, 8, 8)) if name == f"000001_000003.{latents}" else data)
    with tarfile.open(out / "000002.tar") as tar:
        cut = next(m for m in tar if m.name.startswith("000002_000002.")).offset_data + 100
    (out / "000002.tar").write_bytes((out / "000002.tar").read_bytes()[:cut])
    before = _digests(out)

    scan = scan_output(as_output(out))
    assert scan.ignore_index() == {"000000.tar": ["000000_000001", "000000_000002"],
                                   "000001.tar": ["000001_000000", "000001_000003"],
                                   "000002.tar": ["000002_000002", "000002_000003"]}
    reasons = {key: " ".join(r) for keys in scan.broken.values() for key, r in keys.items()}
    assert reasons["000000_000001"].startswith("undecodable:")
    assert reasons["000000_000002"].startswith("missing_member:") and embeds in reasons["000000_000002"]
    assert "NaN" in reasons["000001_000000"] and "shape 16x8x8" in reasons["000001_000003"]
    assert reasons["000002_000003"].startswith("shard_unreadable:")  # after the break: from the manifest

    assert main(["ignore-list", str(out)]) == 1
    assert json.loads((out / contract.IGNORE_INDEX_JSON).read_text()) == scan.ignore_index()
    report = json.loads((out / contract.STATE_DIR / contract.IGNORE_REPORT_JSON).read_text())
    assert report["broken"] == 6 and report["samples"] == 10  # read whole: 4 + 4 + the cut shard's first 2
    assert _digests(out) == before  # never a shard changed
    assert "000001_000003" in capsys.readouterr().out

    # FastGen's deterministic loader: shard_count - len(ignored) per shard, so the written counts stay as they are.
    counts = {m.shard: m.count for m in read_manifests(out).values()}
    assert {s: counts[s] - len(k) for s, k in scan.ignore_index().items()} == {"000000.tar": 2, "000001.tar": 2,
                                                                               "000002.tar": 2}


def test_all_rejected_unit_writes_no_shard(tmp_path, demo_data, tiny_model, settings_for, monkeypatch) -> None:
    for name in ("00004.png", "00005.png", "00006.jpg", "00007.png"):  # unit 1 of 4-sample units
        (demo_data / "images" / name).write_bytes(b"not an image")
    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"layout": "fastgen", "accept_rejects": 0.5},
                            model={"latent_mode": "mode"}, finalize={"train_split": 1.0})
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 8 and result.validation["ok"]
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar", "000002.tar"]
    assert json.loads((out / contract.SHARD_COUNTS_JSON).read_text()) == {"000000.tar": 4, "000002.tar": 4}
    manifest = read_manifests(out)[1]
    assert (manifest.shard, manifest.count, len(manifest.rejects)) == ("", 0, 4)
    report = audit(out, read_plan(out))
    assert (report.written, report.rejected, report.problems) == (8, 4, [])
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}")).action == "complete"
    assert read_manifests(out)[1] == manifest

    # A whole dataset: nothing to ignore, and the list FastGen reads is written empty.
    assert main(["ignore-list", str(out)]) == 0
    assert json.loads((out / contract.IGNORE_INDEX_JSON).read_text()) == {}
    # FastGen's loader rules (its latent key map, ignore_index_paths, shard_counts.json): the empty list loads as
    # an empty ignore index (34f30e8's get_ignore_index: json.load, then no shard), every sample read, counts exact.
    monkeypatch.setattr(webdataset.autodecode, "pytorch_weights_only", True)
    key_map = {"real": contract.FASTGEN_LATENT, "condition": contract.FASTGEN_TXT_EMB}
    ignore_file = [out / contract.IGNORE_INDEX_JSON]
    per_shard = lambda items: {name: sum(os.path.basename(i["__url__"]) == name for i in items)  # noqa: E731
                               for name in ("000000.tar", "000002.tar")}
    shards = fastgen_shards(out)
    assert per_shard(fastgen_samples(out, key_map, ignore_index_paths=ignore_file)) == fastgen_shard_counts(
        out, fastgen_ignore_index(ignore_file, shards)) == {"000000.tar": 4, "000002.tar": 4}
    # A latent broken after the run: listed, its key dropped while iterating, and the deterministic loader's count
    # for its shard (shard_counts.json less the listed keys) is exactly what it reads.
    broken = f"000002_000001.{contract.FASTGEN_LATENT}"
    _rewrite(out / "000002.tar", lambda name, data: data[: len(data) // 2] if name == broken else data)
    assert main(["ignore-list", str(out)]) == 1
    ignore = fastgen_ignore_index(ignore_file, shards)
    assert ignore == {"000002.tar": {"000002_000001"}}
    read = fastgen_samples(out, key_map, ignore_index_paths=ignore_file)
    assert "000002_000001" not in {item["__key__"] for item in read}
    assert per_shard(read) == fastgen_shard_counts(out, ignore) == {"000000.tar": 4, "000002.tar": 3}
    with pytest.raises(Exception):  # unlisted, its decode fails (FastGen warns and skips it, a resume then shifts)
        fastgen_samples(out, key_map)
    assert Layout.of_plan(json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())["settings"]).name \
        == "fastgen"
