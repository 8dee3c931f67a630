"""Byte-identical outputs across refactors: every output file of two fixed runs, against recorded sha256s.

The two scenarios are the demo dataset encoded into a folder, and the demo
dataset encoded into a bucket prefix (moto's S3 server on loopback). The
recorded values (``golden_outputs.json``) were taken before the pipeline was
redesigned; a change that alters a byte of any listed file fails here. The
tensors' last bits depend on the CPU's kernels (AVX2, AVX-512): a set is
recorded per kernel family, and a run must equal one of them.

Some files hold the run's own paths, and the fingerprint computed from them,
or the random id Energon gives an index (``index.uuid``): those are compared
after replacing them with placeholders, ``index.sqlite`` by its SQL dump.
plan.json's record of the machine (its CPU kernels and thread count) is a
placeholder too: the shards compared per kernel family are what depends on it.
Files that record the run itself (timings, free disk space) are left out and
listed in ``VOLATILE``. ``validation.json`` is a report of the shards: its
numbers with a fraction (the latents' mean and std, the round-trip PSNRs)
follow the shards' last bits, so it is compared with each such number as a
placeholder, the same on every CPU kind, and its mean and std are checked
against ``latent_stats.pt`` (``check_derived``). The files computed from the stored latents (each
unit's moments and their merge, ``latent_stats.pt``) are not recorded: their
last bits follow the shards' on each CPU kind, so they are checked against
the shards instead (``check_derived``: recomputed from the stored latents, to
the byte, and equal to the direct statistics), for every CPU kind. To record
new values after a deliberate format change: ``RECORD_GOLDEN_OUTPUTS=1 pytest
tests/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import tarfile
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from diffprep import contract
from diffprep.tools.demo import write_demo_dataset
from flow_runs import parameters
from diffprep.flows.encode import encode_dataset
from latent_direct import close32, direct

GOLDEN = Path(__file__).with_name("golden_outputs.json")
BUCKET = "diffprep-golden"  # created by the admin fixture (conftest.py)
# Record the run, not the data: seconds, free bytes, the lock of the run in progress.
VOLATILE = {".diffprep/sanity/report.json", ".diffprep/lock.json"}
TEXT_SUFFIXES = (".json", ".yaml", ".txt")
VALIDATION = f"{contract.STATE_DIR}/{contract.VALIDATION_JSON}"
# Computed from the stored latents: checked by check_derived, not by a recorded digest.
DERIVED_STATS = f"{contract.STATE_DIR}/{contract.LATENT_STATS}"
DERIVED_UNITS = f"{contract.STATE_DIR}/{contract.UNIT_STATS_DIR}/"
DERIVED_MEMBERS = f"{contract.STATE_DIR}/{contract.MEMBERS_DIR}/"  # the shard writer's member records


def derived(name: str) -> bool:
    return name == DERIVED_STATS or name.startswith((DERIVED_UNITS, DERIVED_MEMBERS))


def normalized_digests(files: dict[str, bytes], replace: dict[str, str]) -> dict[str, str]:
    """relative path -> sha256, text files with the run's paths and fingerprint replaced by placeholders."""
    replace = dict(replace)
    if ".nv-meta/index.uuid" in files:
        replace[files[".nv-meta/index.uuid"].decode().strip()] = "<index-uuid>"
    digests = {}
    for name, data in sorted(files.items()):
        if name in VOLATILE or derived(name):
            continue
        if name.endswith(".sqlite"):
            data = sqlite_dump(data)
        if name.endswith(TEXT_SUFFIXES + (".uuid", ".sqlite")):
            text = data.decode("utf-8")
            for old, new in sorted(replace.items(), key=lambda item: -len(item[0])):
                text = text.replace(old, new)
            data = text.encode("utf-8")
        if name == VALIDATION:
            data = json.dumps(without_fractions(json.loads(data)), indent=1, sort_keys=True).encode("utf-8")
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def without_fractions(value):
    """A JSON value with every float as a placeholder: the numbers that follow the CPU's last bits."""
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, dict):
        return {key: without_fractions(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_fractions(item) for item in value]
    return value


def sqlite_dump(data: bytes) -> bytes:
    """A database's content as SQL text (its file bytes and row order vary with the prepare
    workers, its rows do not)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "index.sqlite"
        path.write_bytes(data)
        db = sqlite3.connect(path)
        try:
            return "\n".join(sorted(db.iterdump())).encode("utf-8")
        finally:
            db.close()


def machine(plan_json: bytes) -> dict[str, str]:
    """plan.json's record of the machine (its CPU kernels and thread count, diffprep/run/threads.py) as placeholders:
    the shards' bytes are what depends on them, and they are compared per kernel family."""
    cpu = json.loads(plan_json)["cpu"]
    return {f'"capability": "{cpu["capability"]}"': '"capability": "<cpu>"',
            f'"threads": {cpu["threads"]}': '"threads": "<threads>"'}


def local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cpu_kernels() -> str:
    """Which CPU kernels computed the tensors: float results differ in their last bits between AVX2 and AVX-512
    (MKL and oneDNN sum in other orders), so each kernel family has its own recorded set."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def check(scenario: str, digests: dict[str, str]) -> None:
    """The digests equal a recorded set: this machine's kernel family's, or another's (an unrecorded family)."""
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    kernels = cpu_kernels()
    if os.environ.get("RECORD_GOLDEN_OUTPUTS") == "1":
        recorded.setdefault(kernels, {})[scenario] = digests
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {len(digests)} digests for {scenario} ({kernels})")
    sets = {name: found[scenario] for name, found in recorded.items() if scenario in found}
    if digests in sets.values():
        return
    name = kernels if kernels in sets else next(iter(sets))
    want = sets[name]
    assert sorted(digests) == sorted(want), f"{scenario}: other files than recorded ({name})"
    changed = [file for file in want if digests[file] != want[file]]
    assert not changed, f"{scenario}: files whose bytes changed against the {name} record: {changed}"


def check_derived(files: dict[str, bytes], members: bool = True) -> None:
    """Each unit's saved moments are those of its shard's latents, recomputed in key order (to the byte, with the
    run's fingerprint), and latent_stats.pt is their merge in unit order (to the byte), equal to the statistics
    computed at once from every stored latent (to float32 precision: the file is float32). ``members``: the shard
    writer's member records are there (a folder output; a bucket's stay in its local staging folder)."""
    from diffprep.report.latent_stats import UnitStats, merge_units
    from diffprep.writer.layouts import Layout
    from diffprep.writer.plan import Plan
    from diffprep.writer.shards import UnitManifest, load_tensor, torch_bytes

    plan = Plan.from_json(json.loads(files[f"{contract.STATE_DIR}/{contract.PLAN_JSON}"]))
    layout = Layout.of_plan(plan.settings)
    units = sorted(name for name in files if name.startswith(f"{contract.STATE_DIR}/{contract.UNITS_DIR}/"))
    assert units, "no unit manifests"
    parts, every = [], []
    for name in units:
        manifest = UnitManifest.from_json(json.loads(files[name]))
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(fileobj=io.BytesIO(files[manifest.shard])) as archive:
            for member in archive.getmembers():
                key, field = member.name.split(".", 1)
                samples.setdefault(key, {})[field] = archive.extractfile(member).read()
            if members:  # the writer's record of the members, for finalize's Energon index
                record = json.loads(files[f"{DERIVED_MEMBERS}{manifest.unit:06d}.json"])
                written = [[m.name, m.offset, m.offset_data, m.size] for m in archive.getmembers()]
                assert record["members"] == written and record["end"] == archive.offset, manifest.shard
                assert (record["sha256"], record["bytes"]) == (manifest.sha256, manifest.bytes), manifest.shard
        assert sorted(samples) == sorted(manifest.keys), manifest.shard
        moments = UnitStats()
        for key in manifest.keys:
            latents = load_tensor(layout.read(samples[key], key)[contract.LATENTS])
            moments.add({contract.LATENTS: latents})
            every.append(latents)
        saved = f"{DERIVED_UNITS}{manifest.unit:06d}.pt"
        assert files.get(saved) == moments.to_bytes(plan.fingerprint), f"{saved} is not its shard's moments"
        parts.append((manifest, moments.fields))
    assert sorted(name for name in files if name.startswith(DERIVED_UNITS)) == [
        f"{DERIVED_UNITS}{int(name.rsplit('/', 1)[1].removesuffix('.json')):06d}.pt" for name in units]
    assert files[DERIVED_STATS] == torch_bytes(merge_units(plan, parts)), "latent_stats.pt is not the units' merge"
    stats = torch.load(io.BytesIO(files[DERIVED_STATS]), weights_only=True)
    mean, std, _ = direct(every)
    assert close32(stats["mean"], mean) and close32(stats["std"], std)
    assert int(stats["count"]) == sum(x[0].numel() for x in every) and int(stats["samples"]) == len(every)
    reported = json.loads(files[VALIDATION])["summary"]["latent_stats"]
    assert reported["mean"] == stats["mean"].tolist() and reported["std"] == stats["std"].tolist(), (
        "validation.json's latent mean/std are not latent_stats.pt's")


@pytest.mark.slow
def test_demo_dataset_to_a_folder_is_byte_identical(prefect_server, tiny_model, tmp_path) -> None:
    data = write_demo_dataset(tmp_path / "demo", samples=24)
    out = tmp_path / "out"
    result = encode_dataset(parameters(data, tiny_model, out, output={"shard_size": 8},
                                       image={"image_size": 64}, finalize={"train_split": 0.8}))
    assert result["validation"]["ok"]
    files = local_files(out)
    replace = {str(tmp_path): "<tmp>", str(tiny_model): "<model>", result["fingerprint"]: "<fingerprint>",
               **machine(files[".diffprep/plan.json"])}
    check("demo-folder", normalized_digests(files, replace))
    check_derived(files)


@pytest.mark.slow
@pytest.mark.usefixtures("aws_env")
def test_demo_dataset_to_a_bucket_is_byte_identical(prefect_server, tiny_model, admin, proxy, tmp_path) -> None:
    data = write_demo_dataset(tmp_path / "demo", samples=12)
    url = f"s3://{BUCKET}/golden/{uuid.uuid4().hex[:8]}"
    result = encode_dataset(parameters(data, tiny_model, url, output={"s3_endpoint_url": proxy.url},
                                       finalize={"train_split": 0.5}))
    assert result["validation"]["ok"]
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    keys = [o["Key"] for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ())]
    files = {key[len(prefix):]: admin.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys}
    replace = {str(tmp_path): "<tmp>", str(tiny_model): "<model>", url: "<url>", proxy.url: "<endpoint>",
               result["fingerprint"]: "<fingerprint>", **machine(files[".diffprep/plan.json"])}
    check("demo-bucket", normalized_digests(files, replace))
    check_derived(files, members=False)
