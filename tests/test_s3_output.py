"""Datasets written to S3-compatible storage, against a real S3 endpoint on loopback (moto's server, over HTTP).

The code under test talks to the fault-injecting proxy of tests/s3_store.py;
the tests read and change the bucket straight through moto (``admin``). A
bucket output must hold the same bytes a local output does, resume only from
units whose manifest object vouches for their shard, ask before it changes a
prefix, and load in Energon from the bucket.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from prefect.client.schemas.objects import StateType

from diffprep.errors import LockedError, SourceError
from diffprep.phases.existing import inspect_output
from diffprep.output import S3Lock, S3Output, open_output
from diffprep.writer.shards import UnitManifest
from diffprep.sources.storage import S3Url
from diffprep.validation import validate_dataset
from flow_runs import BackgroundRun, answer, parameters
from latent_direct import close32
from diffprep.flows.encode import encode_dataset
from s3_store import ACCESS_KEY, SECRET_KEY

BUCKET = "diffprep-out"  # created by the admin fixture (conftest.py)

pytestmark = pytest.mark.usefixtures("aws_env")


def prefix_url() -> str:
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}"


def objects(admin, url: str) -> dict[str, bytes]:
    """Every object under the URL's prefix: path relative to it -> bytes."""
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    keys = [o["Key"] for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ())]
    return {key[len(prefix):]: admin.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys}


def key_of(url: str, relative: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/") + "/" + relative


def path_of(url: str, relative: str) -> str:
    """The request path of an object, as the proxy logs it (path-style addressing on 127.0.0.1)."""
    return f"/{BUCKET}/{key_of(url, relative)}"


def s3_parameters(data: Path, model: Path, url: str, proxy, **sections):
    """encode-dataset parameters writing to ``url`` through the proxy; 12 demo samples in 3 shards of 4."""
    output = {"s3_endpoint_url": proxy.url} | sections.pop("output", {})
    return parameters(data, model, url, output=output, **sections)


def no_secrets(*texts: str | bytes) -> None:
    for text in texts:
        data = text if isinstance(text, bytes) else text.encode()
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data


# --- the whole flow into a bucket ------------------------------------------------------------------


@pytest.mark.slow
def test_flow_to_bucket_equals_local_and_loads_from_the_bucket(prefect_server, tiny_model, demo_data, admin, proxy,
                                                                tmp_path, monkeypatch) -> None:
    url = prefix_url()
    result = encode_dataset(s3_parameters(demo_data, tiny_model, url, proxy, finalize={"train_split": 0.5}))
    assert result["out_dir"] == url and result["action"] == "fresh"
    assert result["samples"] == 12 and result["validation"]["ok"]
    local = tmp_path / "local"
    encode_dataset(parameters(demo_data, tiny_model, local, finalize={"train_split": 0.5}))

    stored = objects(admin, url)
    shards = [f"{u:06d}.tar" for u in range(3)]
    # The same settings give the same bytes, in a bucket or on disk: shards, manifests, indexes, splits.
    for name in shards + [f"{s}.idx" for s in shards] + [
            f".diffprep/units/{u:06d}.json" for u in range(3)] + [".nv-meta/split.yaml", ".diffprep/plan.json"]:
        assert stored[name] == (local / name).read_bytes(), name
    for name in shards:  # each manifest object vouches for its shard: size, sha256, also in the object metadata
        manifest = UnitManifest.from_json(json.loads(stored[f".diffprep/units/{name[:6]}.json"]))
        assert (manifest.bytes, manifest.sha256) == (len(stored[name]), hashlib.sha256(stored[name]).hexdigest())
        # ...and the manifest object records the ETag of exactly that shard object.
        recorded = admin.head_object(Bucket=BUCKET, Key=key_of(url, f".diffprep/units/{name[:6]}.json"))
        shard_etag = admin.head_object(Bucket=BUCKET, Key=key_of(url, name))["ETag"].strip('"')
        assert recorded["Metadata"]["shard-etag"] == shard_etag
    assert {".nv-meta/dataset.yaml", ".nv-meta/.info.json", ".nv-meta/index.sqlite", ".diffprep/audit.json",
            ".diffprep/validation.json", ".diffprep/latent_stats.pt", ".diffprep/msc_config.yaml"} <= set(stored)
    assert ".diffprep/lock.json" not in stored  # released
    staging = Path(os.environ["DIFFPREP_STAGING_DIR"])
    assert not list(staging.rglob("*.tar")), "shards leave the staging folder once uploaded"
    no_secrets(*stored.values(), json.dumps(result))

    # A training job on another machine: the profile from the bucket, the dataset read through Energon's MSC.
    profile = yaml.safe_load(stored[".diffprep/msc_config.yaml"])
    assert profile["profiles"][f"diffprep-{BUCKET}"]["storage_provider"]["options"]["endpoint_url"] == proxy.url
    config = tmp_path / "msc_config.yaml"
    config.write_bytes(stored[".diffprep/msc_config.yaml"])
    proxy.log.clear()
    code = (
        "import sys\n"
        "from megatron.energon import WorkerConfig, get_loader, get_val_dataset\n"
        "from diffprep.writer.cooker import FluxPreencodedTaskEncoder\n"
        "n = 0\n"
        "for split in ('train', 'val', 'test'):\n"
        "    ds = get_val_dataset(sys.argv[1], split_part=split, batch_size=None, worker_config=WorkerConfig("
        "rank=0, world_size=1, num_workers=0), task_encoder=FluxPreencodedTaskEncoder())\n"
        "    n += sum(1 for _ in get_loader(ds, watchdog_timeout_seconds=None))\n"
        "print('loaded', n)\n"
    )
    path = f"msc://diffprep-{BUCKET}/{url.removeprefix(f's3://{BUCKET}/')}"
    loaded = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300,
                            env=os.environ | {"MSC_CONFIG": str(config)})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "loaded 12" in loaded.stdout
    assert proxy.requests("GET", path_of(url, "000001.tar")), "samples come from the bucket"

    # `diffprep validate s3://...` on a machine that never saw the run: everything read back from the bucket.
    monkeypatch.setenv("DIFFPREP_STAGING_DIR", str(tmp_path / "other-machine"))
    proxy.log.clear()
    cli = subprocess.run([sys.executable, "-m", "diffprep", "validate", url, "--s3-endpoint-url", proxy.url],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    assert f"Validation passed: `{url}`" in cli.stdout
    assert "keys, size and sha256 match the unit manifests" in cli.stdout
    for name in shards:
        assert proxy.requests("GET", path_of(url, name)), f"{name} was not read back"
    no_secrets(cli.stdout, cli.stderr)

    # `diffprep ignore-list s3://...`: every sample read from the bucket, the (empty) list written beside the tars.
    from diffprep.validation.ignore_list import scan_output, write_ignore_list

    scanned = open_output(url, endpoint_url=proxy.url)
    scan = scan_output(scanned)
    assert (scan.shards, scan.samples, scan.found) == (3, 12, 0)
    assert write_ignore_list(scanned, scan) == f"{url}/ignore_index.json"
    assert json.loads(objects(admin, url)["ignore_index.json"]) == {}

    # `diffprep latent-stats s3://...` on a third machine: every stored latent read back from the bucket gives the
    # statistics the run saved there.
    from diffprep.cli import main

    monkeypatch.setenv("DIFFPREP_STAGING_DIR", str(tmp_path / "third-machine"))
    proxy.log.clear()
    path = tmp_path / "stats.pt"
    assert main(["latent-stats", url, "--s3-endpoint-url", proxy.url, "--output", str(path)]) == 0
    assert all(proxy.requests("GET", path_of(url, name)) for name in shards), "latents come from the bucket"
    computed = torch.load(path, weights_only=True)
    saved = torch.load(io.BytesIO(stored[".diffprep/latent_stats.pt"]), weights_only=True)
    assert sorted(computed) == sorted(saved) == ["count", "mean", "samples", "std"]
    assert close32(computed["mean"], saved["mean"]) and close32(computed["std"], saved["std"])
    assert (int(computed["count"]), int(computed["samples"])) == (int(saved["count"]), 12)


@pytest.mark.slow
def test_interrupted_upload_is_redone_not_trusted(prefect_server, tiny_model, admin, proxy, tmp_path) -> None:
    """A webdataset source in the bucket, the output in the bucket; uploads cut off at two points, then resumed."""
    import tarfile

    from diffprep.tools.demo import write_demo_dataset

    demo = write_demo_dataset(tmp_path / "demo", samples=12)
    shards = tmp_path / "wds"
    shards.mkdir()
    with tarfile.open(shards / "data-000.tar", "w") as tar:
        for image in sorted((demo / "images").iterdir()):
            tar.add(image, arcname=image.name)
            tar.add(demo / "captions" / f"{image.stem}.txt", arcname=f"{image.stem}.txt")
    source_prefix = f"sources/{uuid.uuid4().hex[:8]}"
    admin.put_object(Bucket=BUCKET, Key=f"{source_prefix}/data-000.tar", Body=(shards / "data-000.tar").read_bytes())
    source = {"type": "webdataset", "input_path": f"s3://{BUCKET}/{source_prefix}/*.tar",
              "s3_endpoint_url": proxy.url, "input_dir": None}

    reference = prefix_url()
    encode_dataset(s3_parameters(demo, tiny_model, reference, proxy, source=source))
    expected = objects(admin, reference)

    url = prefix_url()
    # The manifest of unit 1 is refused (a permission error is not retried): the run stops after its shard.
    proxy.inject("PUT", path_of(url, ".diffprep/units/000001.json"), ("status", 403, "AccessDenied"))
    with pytest.raises(SourceError, match="PutObject refused"):
        encode_dataset(s3_parameters(demo, tiny_model, url, proxy, source=source))
    stored = objects(admin, url)
    assert "000001.tar" in stored and ".diffprep/units/000001.json" not in stored
    # ...and a shard object whose upload was replaced by garbage, its manifest gone: not done, whatever it holds.
    admin.put_object(Bucket=BUCKET, Key=key_of(url, "000000.tar"), Body=b"half an upload")
    admin.delete_object(Bucket=BUCKET, Key=key_of(url, ".diffprep/units/000000.json"))

    result = encode_dataset(s3_parameters(demo, tiny_model, url, proxy, source=source))
    assert result["action"] == "resume" and result["encoded_units"] == 3  # units 0 and 1 redone, 2 never written
    assert result["validation"]["ok"]
    resumed = objects(admin, url)
    for name in ("000000.tar", "000001.tar", "000002.tar", ".diffprep/units/000000.json",
                 ".diffprep/units/000001.json", ".nv-meta/split.yaml"):
        assert resumed[name] == expected[name], name

    # `diffprep finalize` on the bucket again: same splits, validated in place.
    cli = subprocess.run([sys.executable, "-m", "diffprep", "finalize", url, "--s3-endpoint-url", proxy.url],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    assert objects(admin, url)[".nv-meta/split.yaml"] == expected[".nv-meta/split.yaml"]


@pytest.mark.slow
def test_existing_prefix_is_changed_only_after_approval(prefect_server, tiny_model, demo_data, admin, proxy) -> None:
    url = prefix_url()
    encode_dataset(s3_parameters(demo_data, tiny_model, url, proxy, finalize={"enabled": False}))
    planted = {"notes.txt": b"mine", ".nv-meta/custom/keep.yaml": b"mine: true\n", ".diffprep/my-notes.txt": b"m",
               "empty_encodings/user_note.txt": b"keep me"}
    for name, data in planted.items():
        admin.put_object(Bucket=BUCKET, Key=key_of(url, name), Body=data)
    before = objects(admin, url)
    other = {"image": {"image_size": 16}, "finalize": {"enabled": False}}

    run = BackgroundRun(s3_parameters(demo_data, tiny_model, url, proxy, **other))
    paused, question = run.wait_for_question("existing-output")
    assert f"`{url}`" in question and "`notes.txt`" in question and "written with other settings" in question
    answer(paused, "abort")
    assert run.join() == StateType.FAILED
    assert objects(admin, url) == before, "a refusal changes nothing in the bucket"

    # Decided ahead of time: new-dir writes next to it, the prefix stays as it is.
    result = encode_dataset(s3_parameters(demo_data, tiny_model, url, proxy, output={"on_existing": "new-dir"},
                                          **other))
    assert result["out_dir"] == url + "-v2" and result["action"] == "new-dir"
    assert objects(admin, url) == before and len(objects(admin, url + "-v2")) > 3

    run = BackgroundRun(s3_parameters(demo_data, tiny_model, url, proxy, **other))
    paused, _question = run.wait_for_question("existing-output")
    answer(paused, "overwrite")
    assert run.join() == StateType.COMPLETED, run.error
    after = objects(admin, url)
    assert {name: after.get(name) for name in planted} == planted  # objects diffprep did not write stay
    assert after["000000.tar"] != before["000000.tar"]
    assert json.loads(after[".diffprep/plan.json"])["fingerprint"] == run.result["fingerprint"]


@pytest.mark.slow
def test_credentials_block_by_name_and_never_shown(prefect_server, tiny_model, demo_data, admin, proxy,
                                                   monkeypatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from diffprep.blocks.aws_credentials import AwsS3Credentials

    AwsS3Credentials(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").save("test-bucket-keys", overwrite=True)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    url = prefix_url()
    with pytest.raises(SourceError, match=rf"s3://{BUCKET}: ListObjectsV2: no AWS credentials found"):
        encode_dataset(s3_parameters(demo_data, tiny_model, url, proxy))

    run = BackgroundRun(s3_parameters(demo_data, tiny_model, url, proxy,
                                      auth={"aws_credentials_block": "test-bucket-keys"}))
    assert run.join() == StateType.COMPLETED, run.error
    assert run.result["validation"]["ok"]
    with get_client(sync_client=True) as client:
        flow_run = run.flow_run()
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
    assert logs
    no_secrets(json.dumps(flow_run.parameters), json.dumps(run.result), *(entry.message for entry in logs),
               *objects(admin, url).values())
    staging = Path(os.environ["DIFFPREP_STAGING_DIR"])
    no_secrets(*(p.read_bytes() for p in staging.rglob("*") if p.is_file()))


@pytest.mark.slow
def test_raw_pipeline_to_bucket(prefect_server, admin, proxy, tmp_path, capsys) -> None:
    from diffprep.cli import main
    from diffprep.tools.demo import write_demo_dataset

    data = write_demo_dataset(tmp_path / "data", samples=6)
    url = prefix_url()
    assert main(["raw", "--source-type", "directory", "--input-dir", str(data), "--output-dir", url,
                 "--output-s3-endpoint-url", proxy.url, "--shard-size", "4", "--image-size", "32"]) == 0
    assert "validation: passed" in capsys.readouterr().out
    stored = objects(admin, url)
    assert {"000000.tar", "000001.tar", "000001.tar.idx", ".diffprep/units/000001.json"} <= set(stored)
    assert yaml.safe_load(stored[".nv-meta/dataset.yaml"])["subflavors"] == {"encoding": "raw"}
    assert main(["validate", url, "--s3-endpoint-url", proxy.url, "--encoding", "raw"]) == 0

    # Finalize indexed the bucket from the writer's records uploaded with each shard: finalized again on another
    # machine, it reads of each shard only its last member's header (512 bytes), and writes what Energon's prepare
    # writes from the whole shards (run where a record is missing, as for a bucket of an earlier diffprep).
    from diffprep.run.energon import finalize
    from test_energon_index import rows

    assert {".diffprep/members/000000.json", ".diffprep/members/000001.json"} <= set(stored)
    staging = tmp_path / "another-machine"
    recorded = {name: data for name, data in stored.items() if name.endswith(".idx") or name.startswith(".nv-meta/")}
    proxy.log.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFPREP_STAGING_DIR", str(staging))
        out = open_output(url, endpoint_url=proxy.url)
        finalize(out, encoding="raw", train_split=1.0)
        ranges = [r.headers.get("Range") or r.headers.get("range") for r in proxy.log
                  if r.method == "GET" and r.path.endswith(".tar")]
        assert len(ranges) == 2 and all(r is not None and r.startswith("bytes=") for r in ranges)
        assert all(int(end) - int(start) < 512 for start, end in (r[6:].split("-") for r in ranges))
        from_records = objects(admin, url)
        records_rows = rows(out.local / ".nv-meta/index.sqlite")
        admin.delete_object(Bucket=BUCKET, Key=key_of(url, ".diffprep/members/000001.json"))
        proxy.log.clear()
        finalize(open_output(url, endpoint_url=proxy.url), encoding="raw", train_split=1.0)
        assert all(not (r.headers.get("Range") or r.headers.get("range")) for r in proxy.log
                   if r.method == "GET" and r.path.endswith(".tar")), "prepare reads every shard whole"
        prepared = objects(admin, url)
        assert rows(out.local / ".nv-meta/index.sqlite") == records_rows
    for name in ("000000.tar.idx", "000001.tar.idx", ".nv-meta/.info.json", ".nv-meta/split.yaml"):
        assert from_records[name] == prepared[name] == recorded[name], name


# --- the parts, without Prefect --------------------------------------------------------------------


def test_missing_bucket_fails_at_once_naming_it(proxy, make_plan) -> None:
    output = open_output("s3://no-such-bucket/data", endpoint_url=proxy.url)
    with pytest.raises(SourceError, match=r"s3://no-such-bucket: ListObjectsV2 failed: the bucket does not exist"):
        inspect_output(output, make_plan())
    assert len(proxy.log) == 1, "no retry can create a bucket"
    with pytest.raises(SourceError, match="has no prefix"):
        open_output(f"s3://{BUCKET}", endpoint_url=proxy.url)
    with pytest.raises(SourceError, match="a prefix of plain names"):
        open_output(f"s3://{BUCKET}/a/../../etc", endpoint_url=proxy.url)


def test_upload_retries_5xx_and_goes_multipart(admin, proxy, make_plan, write_unit, monkeypatch) -> None:
    import diffprep.output.upload

    url = prefix_url()
    output = open_output(url, endpoint_url=proxy.url)
    plan = make_plan(sizes=(4,), expected={"latents": [16, 256, 256], "prompt_embeds": [16, 32],
                                           "pooled_prompt_embeds": [32], "dtype": "float32"})
    manifest = write_unit(output.local, plan, 0)
    assert manifest.bytes > 12 << 20
    monkeypatch.setattr(diffprep.output.upload, "MULTIPART_CHUNK", 5 << 20)  # S3's smallest part
    shard = path_of(url, "000000.tar")
    proxy.inject("POST", shard, ("status", 503, "SlowDown"))  # CreateMultipartUpload
    proxy.inject("PUT", shard, ("status", 500, "InternalError"), ("status", 503, "SlowDown"))  # parts
    proxy.inject("PUT", path_of(url, ".diffprep/units/000000.json"), ("status", 503, "SlowDown"))
    output.commit_unit(manifest)  # the shard staged whole, no upload under way: sent now

    stored = objects(admin, url)
    assert hashlib.sha256(stored["000000.tar"]).hexdigest() == manifest.sha256
    assert json.loads(stored[".diffprep/units/000000.json"]) == manifest.to_json()
    parts = [r for r in proxy.requests("PUT", shard) if "partNumber=" in r.query and r.status == 200]
    assert len(parts) == -(-manifest.bytes // (5 << 20)), "the shard goes up in 5 MiB parts"
    assert [r.status for r in proxy.requests("POST", shard)][:2] == [503, 200]
    assert not (output.local / "000000.tar").exists()
    assert output.committed_unit(0, plan.fingerprint) == manifest


def test_a_sync_by_another_process_mid_commit_keeps_the_unit(admin, proxy, make_plan, write_unit) -> None:
    # Workers and ranks on one machine share a bucket output's staging folder; one syncing its manifests while
    # another commits (its shard up, its manifest object not yet) must not take the committing one's unit away.
    url = prefix_url()
    output, other = open_output(url, endpoint_url=proxy.url), open_output(url, endpoint_url=proxy.url)
    assert other.local == output.local
    plan = make_plan(sizes=(4,))
    manifest = write_unit(output.local, plan, 0)
    proxy.inject("HEAD", path_of(url, "000000.tar"), ("before", other.state.manifest_units))
    output.commit_unit(manifest)  # the shard's read-back check comes after its upload, before the manifest's PUT

    assert any("list-type=2" in r.query for r in proxy.requests("GET", f"/{BUCKET}"))  # the other one did sync
    assert output.committed_unit(0, plan.fingerprint) == manifest
    assert output.state.manifests() == {0: manifest}  # the staged copy is there, and the bucket agrees


def test_a_unit_whose_every_sample_was_rejected_commits_its_manifest_alone(admin, proxy, make_plan,
                                                                          write_unit) -> None:
    url = prefix_url()
    output = open_output(url, endpoint_url=proxy.url)
    plan = make_plan(sizes=(2,))
    manifest = write_unit(output.local, plan, 0, rejects={"img0000.png": "image_truncated",
                                                          "img0001.png": "image_truncated"})
    assert (manifest.shard, manifest.count) == ("", 0)
    output.commit_unit(manifest, output.shard_sink(0))
    stored = objects(admin, url)
    assert not [name for name in stored if name.endswith(".tar")]  # no shard object, and no upload left open
    assert json.loads(stored[".diffprep/units/000000.json"])["rejects"][1]["source_id"] == "img0001.png"
    assert open_output(url, endpoint_url=proxy.url).committed_unit(0, plan.fingerprint) == manifest


def test_shard_goes_up_while_it_is_written(admin, proxy, make_plan, monkeypatch) -> None:
    import diffprep.output.upload
    from diffprep.writer.shards import ShardWriter

    monkeypatch.setattr(diffprep.output.upload, "MULTIPART_CHUNK", 5 << 20)
    url = prefix_url()
    output = open_output(url, endpoint_url=proxy.url)
    shard = path_of(url, "000000.tar")
    blob = os.urandom(1 << 20)

    upload = output.shard_sink(0)
    with ShardWriter(output.local, 0, upload) as writer:  # a failure mid-shard: nothing appears in the bucket
        for index in range(7):
            writer.write(f"000000_{index:06d}", {"bin": blob})
    assert [r for r in proxy.requests("PUT", shard) if "partNumber=" in r.query]
    assert any("uploadId=" in r.query for r in proxy.requests("DELETE", shard)), "the parts are discarded"
    assert "000000.tar" not in objects(admin, url)

    proxy.log.clear()
    with ShardWriter(output.local, 0, upload) as writer:  # the same sink, tried again
        for index in range(12):
            writer.write(f"000000_{index:06d}", {"bin": blob})
            if index == 10:  # 11 MiB written, the shard not complete: two parts are on their way
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and len(
                        [r for r in proxy.requests("PUT", shard) if "partNumber=" in r.query]) < 2:
                    time.sleep(0.05)
                sent_early = len([r for r in proxy.requests("PUT", shard) if "partNumber=" in r.query])
        info = writer.commit()
    assert sent_early == 2, "parts go up before the shard is complete"
    plan = make_plan(sizes=(12,))
    manifest = UnitManifest(unit=0, shard=info.name, fingerprint=plan.fingerprint,
                            keys=[f"000000_{i:06d}" for i in range(12)],
                            source_ids=[f"img{i:04d}.png" for i in range(12)], count=12,
                            bytes=info.bytes, sha256=info.sha256)
    local_bytes = (output.local / "000000.tar").read_bytes()
    output.commit_unit(manifest, upload)
    assert objects(admin, url)["000000.tar"] == local_bytes
    assert output.committed_unit(0, plan.fingerprint) is not None
    # The shard object replaced behind the manifest's back: no longer committed.
    admin.put_object(Bucket=BUCKET, Key=key_of(url, "000000.tar"), Body=local_bytes)
    assert output.committed_unit(0, plan.fingerprint) is None


def test_unfinished_uploads_of_dead_runs_are_aborted(admin, proxy) -> None:
    url = prefix_url()
    admin.create_multipart_upload(Bucket=BUCKET, Key=key_of(url, "000003.tar"))
    admin.create_multipart_upload(Bucket=BUCKET, Key="elsewhere/000003.tar")
    output = open_output(url, endpoint_url=proxy.url)
    assert output.abort_stale_uploads() == ["000003.tar"]
    left = [u["Key"] for u in admin.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert key_of(url, "000003.tar") not in left and "elsewhere/000003.tar" in left


def test_validate_of_an_empty_prefix_fails(admin, proxy) -> None:
    url = prefix_url()
    report = validate_dataset(open_output(url, endpoint_url=proxy.url))
    assert not report.ok and "holds no objects" in report.to_markdown()


def test_one_run_at_a_time_per_prefix(admin, proxy, monkeypatch) -> None:
    url = S3Url(BUCKET, prefix_url().removeprefix(f"s3://{BUCKET}/"))
    monkeypatch.setenv("DIFFPREP_S3_LOCK_LEASE", "2")
    first = S3Lock(S3Output(url, endpoint_url=proxy.url), run="run-one")
    first.acquire()
    # Another machine (its own staging folder): refused while the holder's heartbeat keeps the lease fresh.
    monkeypatch.setenv("DIFFPREP_STAGING_DIR", os.environ["DIFFPREP_STAGING_DIR"] + "-other")
    time.sleep(2.5)
    with pytest.raises(LockedError,
                       match=r"being written by another run \(host .*, pid \d+, user .*, flow run run-one\)"):
        S3Lock(S3Output(url, endpoint_url=proxy.url), run="run-two").acquire()
    with pytest.raises(LockedError, match="a plain run"):
        S3Lock(S3Output(url, endpoint_url=proxy.url), run="shard", shard=1).acquire()

    first.release()
    assert ".diffprep/lock.json" not in objects(admin, str(url))

    # A holder on another machine: refused while its lease runs (a long one here, whatever the machine's load)...
    holder = {"host": "another-machine", "pid": 4242, "user": "someone", "run": "run-one", "lease_s": 300}
    lock_key = key_of(str(url).rstrip("/"), ".diffprep/lock.json")
    admin.put_object(Bucket=BUCKET, Key=lock_key, Body=json.dumps(holder).encode())
    with pytest.raises(LockedError, match="host another-machine"):
        S3Lock(S3Output(url, endpoint_url=proxy.url), run="run-two").acquire()
    # ...and when it died without releasing, its lease runs out and the next run takes the lock over.
    admin.put_object(Bucket=BUCKET, Key=lock_key, Body=json.dumps(holder | {"lease_s": 2}).encode())
    time.sleep(2.5)
    second = S3Lock(S3Output(url, endpoint_url=proxy.url), run="run-two")
    second.acquire()
    holder = json.loads(admin.get_object(Bucket=BUCKET, Key=key_of(str(url).rstrip("/"), ".diffprep/lock.json"))
                        ["Body"].read())
    assert holder["run"] == "run-two"
    second.release()
    assert ".diffprep/lock.json" not in objects(admin, str(url))


def test_a_dead_holder_on_this_machine_does_not_wait_out_the_lease(admin, proxy) -> None:
    import socket

    url = prefix_url()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"host": socket.gethostname(), "pid": int(dead.stdout), "user": "someone", "run": "killed-run",
              "lease_s": 300}
    admin.put_object(Bucket=BUCKET, Key=key_of(url, ".diffprep/lock.json"), Body=json.dumps(record).encode())
    output = open_output(url, endpoint_url=proxy.url)
    with output.lock(run="next-run"):
        held = json.loads(admin.get_object(Bucket=BUCKET, Key=key_of(url, ".diffprep/lock.json"))["Body"].read())
        assert held["run"] == "next-run"
    record["host"] = "another-machine"  # elsewhere, its pid tells nothing: the lease must run out
    admin.put_object(Bucket=BUCKET, Key=key_of(url, ".diffprep/lock.json"), Body=json.dumps(record).encode())
    with pytest.raises(LockedError, match="host another-machine"):
        output.lock(run="next-run").__enter__()


def test_concurrent_runs_have_one_winner(admin, proxy, tmp_path) -> None:
    url = S3Url(BUCKET, prefix_url().removeprefix(f"s3://{BUCKET}/"))
    winners, errors = [], []

    def contend(index: int) -> None:
        output = S3Output(url, endpoint_url=proxy.url)
        output.local = tmp_path / f"machine-{index}"  # four machines, each its own staging folder
        lock = output.lock(run=f"run-{index}")
        try:
            lock.acquire()
            winners.append(lock)
        except LockedError as error:
            errors.append(error)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and len(errors) == 3
    assert all("being written by another run" in str(error) for error in errors)
    winners[0].release()
    assert ".diffprep/lock.json" not in objects(admin, str(url))


@pytest.mark.slow
def test_a_link_in_the_staging_folder_is_never_written_through(prefect_server, admin, proxy, tmp_path,
                                                               capsys) -> None:
    """A bucket output is worked through a local staging folder: a link there is refused as in an output folder."""
    from diffprep.cli import main
    from diffprep.tools.demo import write_demo_dataset

    data = write_demo_dataset(tmp_path / "data", samples=4)
    url = prefix_url()
    args = ["raw", "--source-type", "directory", "--input-dir", str(data), "--output-dir", url,
            "--output-s3-endpoint-url", proxy.url, "--shard-size", "4", "--image-size", "32"]
    assert main(args) == 0
    staging = open_output(url, endpoint_url=proxy.url).local
    for linked in (".diffprep", ".nv-meta", ".diffprep/units"):
        outside = tmp_path / f"outside-{linked.replace('/', '_')}"
        os.replace(staging / linked, outside)
        os.symlink(outside, staging / linked)
        before = {p.relative_to(outside).as_posix(): p.read_bytes() for p in outside.rglob("*") if p.is_file()}
        stored = objects(admin, url)
        for answer in ("overwrite", "resume"):
            assert main([*args, "--image-size", "64", "--on-existing", answer]) != 0
            assert f"`{linked}` -> {outside}" in capsys.readouterr().err
        assert {p.relative_to(outside).as_posix(): p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
        assert objects(admin, url) == stored  # nothing in the bucket changed either
        (staging / linked).unlink()
        os.replace(outside, staging / linked)
