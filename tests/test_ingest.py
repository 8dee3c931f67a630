"""`diffprep ingest` of MLPerf Flux's format: a .uri/.md5 manifest of Arrow IPC stream files, written here; several
manifests into one dataset from a Primus-style config (Primus's own file: tests/test_primus_configs.py)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest
import torch
import yaml

from diffprep import contract
from diffprep.cli import main
from diffprep.writer.cooker import load_bf16_npy
from diffprep.encodings.ingested import npy_header, row_fields
from diffprep.run.energon import read_split_yaml
from diffprep.errors import SourceError
from diffprep.run.failpoints import ENV as FAILPOINT_ENV
from diffprep.tools.ingest_settings import load_ingest
from diffprep.writer.shards import Reject
from diffprep.sources.mlperf import Prefetcher, download, parse_md5_lines, read_manifest, safe_file_name

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"t5_encodings": (6, 8), "clip_encodings": (8,), "mean": (4, 2, 2), "logvar": (4, 2, 2)}


def bf16_npy(shape, seed: int) -> bytes:
    """bfloat16 values saved as uint16 .npy words, as MLPerf stores them."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    buffer = io.BytesIO()
    np.save(buffer, values.view(torch.int16).numpy().view(np.uint16), allow_pickle=False)
    return buffer.getvalue()


def write_arrow(path: Path, rows: int, seed: int, *, keys: bool, null_mean_row: int | None = None) -> None:
    columns = {name: [bf16_npy(shape, seed * 100 + row * 10 + i) for row in range(rows)]
               for i, (name, shape) in enumerate(SHAPES.items())}
    if null_mean_row is not None:
        columns["mean"][null_mean_row] = None
    arrays = {name: pa.array(values, type=pa.binary()) for name, values in columns.items()}
    if keys:
        arrays["__key__"] = pa.array([f"{path.stem}-{row:04d}" for row in range(rows)])
    table = pa.table(arrays)
    with pa.OSFile(str(path), "wb") as sink, pyarrow.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):  # several record batches per file
            writer.write_batch(batch)


def write_manifest(folder: Path, name: str, files: dict[str, bytes | None], base: str | None = None) -> Path:
    """``<name>.uri`` (the folder as base) and ``<name>.md5`` for the files already in ``folder`` (or given md5s)."""
    lines = []
    for file_name, md5 in files.items():
        digest = md5 or hashlib.md5((folder / file_name).read_bytes()).hexdigest()
        lines.append(f"{digest}  {file_name}")
    (folder / f"{name}.md5").write_text("\n".join(lines) + "\n")
    (folder / f"{name}.uri").write_text((base or str(folder)) + "\n")
    return folder / f"{name}.uri"


@pytest.fixture(scope="module")
def mlperf(tmp_path_factory) -> Path:
    """Three files of 3 rows (the first with __key__, the second with one row missing its mean) and empty
    encodings: a folder that is its own base URL."""
    return write_mlperf(tmp_path_factory.mktemp("mlperf"), files=3, null_mean_row=2)


def write_mlperf(folder: Path, files: int, null_mean_row: int | None = None) -> Path:
    """``files`` Arrow files of 3 rows (the first with __key__; the second missing the mean of ``null_mean_row``)
    and their manifest, and the empty encodings with theirs in ``empty/``: a folder that is its own base URL."""
    names = [f"data-{i:05d}.arrow" for i in range(files)]
    for i, name in enumerate(names):
        write_arrow(folder / name, 3, i, keys=i == 0, null_mean_row=null_mean_row if i == 1 else None)
    write_manifest(folder, "flux-1-tiny-preprocessed", dict.fromkeys(names))
    empty = folder / "empty"
    empty.mkdir()
    for name, shape in ((contract.T5_EMPTY, (1, 6, 8)), (contract.CLIP_EMPTY, (1, 8))):
        np.save(empty / name, np.zeros(shape, np.float32), allow_pickle=False)
    write_manifest(empty, "flux-1-empty-encodings", dict.fromkeys([contract.T5_EMPTY, contract.CLIP_EMPTY]))
    return folder


class Files(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files``; the first ``server.fail[name]`` requests of a name get a 503."""

    def do_GET(self):  # noqa: N802 - http.server's name
        name = self.path.lstrip("/")
        self.server.requests.append(name)
        if self.server.fail.get(name, 0) > 0:
            self.server.fail[name] -= 1
            self.send_error(503)
            return
        data = self.server.files.get(name)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    httpd.files, httpd.fail, httpd.requests = {}, {}, []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


# --- names, manifests, downloads --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../evil.arrow", "/etc/passwd", "a/b.arrow", "..", ".", "a\\b.arrow", "C:x.arrow",
                                  "~root", "x\x00.arrow", ""])
def test_a_name_that_could_leave_the_folder_is_refused(name):
    with pytest.raises(SourceError, match="not one plain file name"):
        safe_file_name(name)
    with pytest.raises(SourceError):
        parse_md5_lines(f"{'0' * 32}  ok.arrow\n{'1' * 32}  {name}\n", "m.md5")


def test_the_manifest_is_read_sorted_and_malformed_lines_are_refused(tmp_path):
    entries = parse_md5_lines(f"{'b' * 32}  b.arrow\n\n{'A' * 32} *a.arrow\n", "m.md5")
    assert [(e.name, e.md5) for e in entries] == [("a.arrow", "a" * 32), ("b.arrow", "b" * 32)]
    for text, match in ((f"{'a' * 31}  a.arrow", "32 hex"), ("a.arrow", "32 hex"),
                        (f"{'a' * 32}  a.arrow\n{'b' * 32}  a.arrow", "twice"), ("\n", "no files")):
        with pytest.raises(SourceError, match=match):
            parse_md5_lines(text, "m.md5")
    (tmp_path / "m.uri").write_text("one\ntwo\n")
    (tmp_path / "m.md5").write_text(f"{'a' * 32}  a.arrow\n")
    with pytest.raises(SourceError, match="one line"):
        read_manifest(str(tmp_path / "m.md5"))


def test_a_download_retries_transient_errors_and_checks_the_md5(server, tmp_path):
    data = b"arrow bytes" * 100
    server.files["f.arrow"] = data
    server.fail["f.arrow"] = 2
    md5 = hashlib.md5(data).hexdigest()
    path = download(f"{server.url}/f.arrow", tmp_path / "f.arrow", md5, retries=3, backoff_s=0.01)
    assert path.read_bytes() == data and server.requests == ["f.arrow"] * 3
    # A file that never matches its md5 fails after its retries, leaving nothing behind.
    server.requests.clear()
    with pytest.raises(SourceError, match="md5") as failure:
        download(f"{server.url}/f.arrow", tmp_path / "g.arrow", "0" * 32, retries=2, backoff_s=0.01)
    assert "after 3 attempts" in str(failure.value) and len(server.requests) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.arrow"]
    # Not found is not retried.
    server.requests.clear()
    with pytest.raises(SourceError, match="404"):
        download(f"{server.url}/missing.arrow", tmp_path / "m.arrow", md5, retries=3, backoff_s=0.01)
    assert server.requests == ["missing.arrow"]


def test_the_prefetch_keeps_at_most_its_depth_on_disk(server, tmp_path):
    names = [f"{i}.arrow" for i in range(5)]
    for name in names:
        server.files[name] = name.encode() * 10
    write_manifest(tmp_path, "m", {n: hashlib.md5(n.encode() * 10).hexdigest() for n in names}, base=server.url)
    manifest = read_manifest(str(tmp_path / "m.uri"))
    folder = tmp_path / "downloads"
    with Prefetcher(manifest, names, folder, depth=2, workers=2, retries=0) as prefetcher:
        assert prefetcher.get(names[0]).read_bytes() == server.files[names[0]]
        time.sleep(0.5)
        assert sorted(p.name for p in folder.iterdir()) == names[:2]  # nothing beyond the depth
        for name in names:
            assert prefetcher.get(name).read_bytes() == server.files[name]
            prefetcher.release(name)
            assert len(list(folder.iterdir())) <= 2
    assert list(folder.iterdir()) == []
    # A planned file the manifest no longer lists fails its get(), never hangs it.
    with Prefetcher(manifest, ["gone.arrow"], folder, retries=0) as prefetcher:
        with pytest.raises(SourceError, match="no longer listed"):
            prefetcher.get("gone.arrow")


def test_a_row_with_a_missing_or_foreign_column_is_a_reject():
    row = {name: bf16_npy(shape, 1) for name, shape in SHAPES.items()}
    fields = row_fields(row, "f#0", "000000_000000")
    assert fields[contract.T5_BYTES] == row["t5_encodings"]  # the bytes as stored
    assert fields[contract.INGESTED_META] == {"key": "000000_000000", "source_id": "f#0"}
    assert npy_header(fields[contract.MEAN_BYTES]) == ((4, 2, 2), np.dtype("<u2"))
    assert load_bf16_npy(fields[contract.CLIP_BYTES]).dtype == torch.bfloat16
    assert row_fields(row | {"mean": None}, "f#0", "k").reason == "missing_column"
    as_float = io.BytesIO()
    np.save(as_float, np.zeros(4, np.float32))
    assert row_fields(row | {"logvar": as_float.getvalue()}, "f#0", "k").reason == "bad_dtype"
    assert isinstance(row_fields(row | {"clip_encodings": b"not npy"}, "f#0", "k"), Reject)


# --- the whole ingest -------------------------------------------------------------------------------------------------


def _args(mlperf: Path, out: Path, *extra: str) -> list[str]:
    return ["ingest", "--manifest", str(mlperf / "flux-1-tiny-preprocessed.md5"), "--output-dir", str(out),
            "--empty-encodings", str(mlperf / "empty" / "flux-1-empty-encodings.uri"), "--prefetch-depth", "2",
            "--accept-rejects", "0.2", "--train-split", "0.34", "--retries", "1", "--backoff-s", "0.01",
            *extra]


def _snapshot(out: Path) -> dict[str, str]:
    files = sorted(out.glob("*.tar")) + sorted((out / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json"))
    files += [out / contract.NV_META / contract.SPLIT_YAML, out / contract.NV_META / contract.INFO_JSON]
    files += sorted((out / contract.EMPTY_ENCODINGS_DIR).iterdir())
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_an_ingest_killed_before_a_commit_resumes_to_the_same_dataset(mlperf, tmp_path):
    reference = tmp_path / "reference"
    assert main(_args(mlperf, reference)) == 0

    audit = json.loads((reference / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert (audit["inputs"], audit["written"], audit["rejected"], audit["ok"]) == (9, 8, 1, True)
    assert audit["rejected_ids"] == [{"source_id": "data-00001.arrow#2", "reason": "missing_column",
                                      "detail": "the row has no mean value"}]
    validation = json.loads((reference / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert validation["ok"], validation
    assert "encoding: preencoded_numpy" in (reference / contract.NV_META / contract.DATASET_YAML).read_text()
    assert not (reference / contract.STATE_DIR / contract.DOWNLOADS_DIR).exists()  # every download removed

    with tarfile.open(reference / "000000.tar") as tar:
        members = tar.getnames()
        meta = json.loads(tar.extractfile("000000_000001.json").read())
        t5 = tar.extractfile("000000_000001.t5.bytes").read()
    assert members[:5] == [f"000000_000000.{f}" for f in sorted(contract.INGESTED_FIELDS)]
    assert meta == {"key": "data-00000-0001", "source_id": "data-00000.arrow#1"}
    table = pyarrow.ipc.open_stream(str(mlperf / "data-00000.arrow")).read_all()
    assert t5 == table.column("t5_encodings")[1].as_py()  # stored as it came
    with tarfile.open(reference / "000001.tar") as tar:
        assert sorted({n.split(".")[0] for n in tar.getnames()}) == ["000001_000000", "000001_000001"]
    assert np.load(reference / contract.EMPTY_ENCODINGS_DIR / contract.T5_EMPTY).shape == (1, 6, 8)

    out = tmp_path / "out"
    env = os.environ | {FAILPOINT_ENV: "before-manifest@2", "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-m", "diffprep", *_args(mlperf, out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (out / contract.STATE_DIR / contract.UNITS_DIR).iterdir()) == ["000000.json"]
    assert main(_args(mlperf, out)) == 0
    assert _snapshot(out) == _snapshot(reference)
    leftovers = [str(p) for p in out.rglob("*") if p.name.endswith((".tmp", ".part")) or p.name.startswith("lock")]
    assert leftovers == []
    # Complete: a third run ingests nothing and changes nothing.
    assert main(_args(mlperf, out)) == 0
    assert _snapshot(out) == _snapshot(reference)


def test_validate_as_a_fresh_process_passes_an_ingested_dataset_as_the_run_did(mlperf, server, tmp_path, capsys,
                                                                             caplog):
    """`diffprep validate OUT` on an ingest's output (its manifest served over HTTP): the report the run's own
    validation passed prints, with each field's shapes as every encoding gives them; the previews say in words
    why there are none, and the run's summary says nothing of a round trip that did not happen."""
    names = [f"data-{i:05d}.arrow" for i in range(3)]
    server.files = {name: (mlperf / name).read_bytes() for name in names}
    served = tmp_path / "served"
    served.mkdir()
    for name in names:
        (served / name).write_bytes(server.files[name])
    manifest = write_manifest(served, "flux-1-tiny-preprocessed", dict.fromkeys(names), base=server.url)
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="diffprep")
    assert main(["ingest", "--manifest", str(manifest), "--output-dir", str(out), "--accept-rejects", "0.2",
                 "--retries", "1", "--backoff-s", "0.01"]) == 0
    summary = capsys.readouterr()
    assert "validation: passed" in summary.out and "    mean: 4x2x2 bfloat16" in summary.out
    assert "no previews: this dataset was encoded elsewhere" in summary.out
    assert "previews: no previews" not in summary.out and "ConfigError" not in summary.out + summary.err
    sanity = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sanity: ")]
    assert len(sanity) == 1 and "PSNR" not in sanity[0] and "round trip" not in sanity[0], sanity
    assert sorted(server.requests) == names

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PYTHONPATH": str(REPO)}
    # --full: the field counts below are of every sample (by default one per shard is loaded).
    checked = subprocess.run([sys.executable, "-m", "diffprep", "validate", str(out), "--full"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    report = checked.stdout
    assert f"# Validation passed: `{out}`" in report and "Traceback" not in checked.stderr
    assert "| mean | 4x2x2 ×8; bfloat16 |" in report and "| prompt_embeds | 6x8 ×8; bfloat16 |" in report
    assert "no previews: this dataset was encoded elsewhere" in report and "ConfigError" not in report
    validation = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert validation["summary"]["fields"]["logvar"] == {"shapes": {"4x2x2": 8}, "dtypes": {"bfloat16": 8}}


def test_a_manifest_naming_a_path_outside_the_folder_is_refused_before_any_download(mlperf, tmp_path, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    write_manifest(folder, "m", {"../data-00000.arrow": "0" * 32})
    assert main(["ingest", "--manifest", str(folder / "m.uri"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "not one plain file name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_file_whose_md5_does_not_match_fails_the_run_and_keeps_nothing(mlperf, tmp_path, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    write_arrow(folder / "a.arrow", 2, 0, keys=False)
    write_manifest(folder, "m", {"a.arrow": "0" * 32}, base=folder.as_uri())  # a file:// base URL
    out = tmp_path / "out"
    assert main(["ingest", "--manifest", str(folder / "m.uri"), "--output-dir", str(out), "--retries", "1",
                 "--backoff-s", "0.01"]) == 2
    assert "md5" in capsys.readouterr().err
    assert list(out.glob("*.tar")) == []
    assert list((out / contract.STATE_DIR / contract.DOWNLOADS_DIR).glob("*")) == []


# --- several datasets into one (a Primus data diffusion-ingest config) -----------------------------------------------


def _datasets_config(mlperf: Path, folder: Path, datasets: dict[str, tuple[list[int], str]], **pipeline) -> Path:
    """A Primus-style ingest config over the ``mlperf`` fixture's files: dataset -> (its file indexes, split)."""
    entries = []
    for name, (files, split) in datasets.items():
        listed = {f"data-{i:05d}.arrow": hashlib.md5((mlperf / f"data-{i:05d}.arrow").read_bytes()).hexdigest()
                  for i in files}
        uri = write_manifest(folder, f"flux-1-{name}-preprocessed", listed, base=str(mlperf))
        entries.append({"name": name, "manifest_url": str(uri), "split_name": split})
    config = {"datasets": entries,
              "empty_encodings": {"manifest_url": str(mlperf / "empty" / "flux-1-empty-encodings.uri"),
                                  "output_subdir": "empty_encodings"},
              "output": {"output_dir": "${INGEST_TEST_ROOT:/nonexistent}/mlperf_flux1"},
              "pipeline": {"max_workers": 2, "prefetch_depth": 2, "max_files": None, **pipeline}}
    path = folder / "mlperf_flux1.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _config_args(config: Path, out: Path, *extra: str) -> list[str]:
    return ["ingest", "--config", str(config), "--output-dir", str(out), "--accept-rejects", "0.2", "--retries", "1",
            "--backoff-s", "0.01", *extra]


def test_datasets_resume_grow_and_keep_their_splits(mlperf, tmp_path, capsys):
    """Units one per file across the datasets, stable when killed and resumed and when a manifest grows; each shard
    in its dataset's split; a split_name changed later moves recorded shards only when approved."""
    config = _datasets_config(mlperf, tmp_path, {"cc12m": ([0, 1], "train"), "coco": ([2], "val")})
    reference = tmp_path / "reference"
    assert main(_config_args(config, reference)) == 0
    from diffprep.writer.plan import read_plan

    assert [u.source_ids for u in read_plan(reference).units] == [["cc12m/data-00000.arrow"],
                                                                  ["cc12m/data-00001.arrow"], ["coco/data-00002.arrow"]]
    assert read_split_yaml(reference) == {"000000.tar": "train", "000001.tar": "train", "000002.tar": "val"}
    audit = json.loads((reference / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert audit["rejected_ids"][0]["source_id"] == "cc12m/data-00001.arrow#2"

    out = tmp_path / "out"
    env = os.environ | {FAILPOINT_ENV: "before-manifest@2", "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-m", "diffprep", *_config_args(config, out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert main(_config_args(config, out)) == 0
    assert _snapshot(out) == _snapshot(reference)

    # cc12m's manifest grows by a file: the old units stay, the new file is unit 3, in train.
    before = _snapshot(out)
    grown = _datasets_config(mlperf, tmp_path, {"cc12m": ([0, 1, 2], "train"), "coco": ([2], "val")})
    assert main(_config_args(grown, out)) == 0
    assert read_split_yaml(out) == {"000000.tar": "train", "000001.tar": "train", "000002.tar": "val",
                                    "000003.tar": "train"}
    assert {k: v for k, v in _snapshot(out).items() if k in before and k.endswith(".tar")} == {
        k: v for k, v in before.items() if k.endswith(".tar")}

    # COCO now says test: nobody to ask, so nothing moves; approved, its shard moves.
    moved = _datasets_config(mlperf, tmp_path, {"cc12m": ([0, 1, 2], "train"), "coco": ([2], "test")})
    capsys.readouterr()
    assert main(_config_args(moved, out)) == 2
    err = capsys.readouterr().err
    assert "1 shard(s) of" in err and "`000002.tar`: val → test" in err, err[-2000:]
    assert read_split_yaml(out)["000002.tar"] == "val"
    assert main(_config_args(moved, out, "--on-split-change", "replace")) == 0
    assert read_split_yaml(out)["000002.tar"] == "test"


def test_an_ingest_config_takes_the_environment_and_flags_over_its_values(mlperf, tmp_path, monkeypatch):
    config = _datasets_config(mlperf, tmp_path, {"cc12m": ([0], "train")}, max_files=1)
    monkeypatch.setenv("INGEST_TEST_ROOT", str(tmp_path / "root"))
    settings, ingest = load_ingest(config, {}, {})
    assert settings.output.output_dir == str(tmp_path / "root" / "mlperf_flux1")
    assert (ingest.download_workers, ingest.prefetch_depth, ingest.max_files) == (2, 2, 1)
    assert ingest.empty_encodings == str(mlperf / "empty" / "flux-1-empty-encodings.uri")
    assert [(d.name, d.split) for d in ingest.datasets] == [("cc12m", "train")]
    monkeypatch.setenv("DIFFPREP_OUTPUT__OUTPUT_DIR", str(tmp_path / "env"))
    assert load_ingest(config, {}, {})[0].output.output_dir == str(tmp_path / "env")
    settings, ingest = load_ingest(config, {"output": {"output_dir": str(tmp_path / "flag")}}, {"max_files": 3})
    assert (settings.output.output_dir, ingest.max_files) == (str(tmp_path / "flag"), 3)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(extra={"a": 1}), "unknown section 'extra' in an ingest config; valid sections: datasets, "
                                         "empty_encodings, pipeline, output, finalize"),
    (lambda c: c["datasets"][0].update(path="x"), "unknown key 'path' in datasets[0]; valid keys: name, "
                                                  "manifest_url, split_name"),
    (lambda c: c["datasets"][0].pop("split_name"), "datasets[0] has no split_name"),
    (lambda c: c["datasets"][0].update(split_name="eval"), "datasets.0.split: Input should be 'train', 'val' or "
                                                           "'test'"),
    (lambda c: c["datasets"].append(dict(c["datasets"][0])), "dataset names must be unique: ['cc12m'] given twice"),
    (lambda c: c["pipeline"].update(workers=3), "unknown key 'workers' in section 'pipeline'; valid keys: "
                                                "max_workers, prefetch_depth, max_files"),
    (lambda c: c["empty_encodings"].update(output_subdir="empties"), "empty_encodings.output_subdir is 'empties'"),
    (lambda c: c["output"].update(shard_size=3), "unknown key 'shard_size' in section 'output'; valid keys: "
                                                 "output_dir, s3_endpoint_url"),
])
def test_an_ingest_config_with_a_key_it_does_not_know_is_refused_with_the_valid_ones(mlperf, tmp_path, capsys,
                                                                                     change, message):
    config = _datasets_config(mlperf, tmp_path, {"cc12m": ([0], "train")})
    data = yaml.safe_load(config.read_text())
    change(data)
    config.write_text(yaml.safe_dump(data))
    assert main(["ingest", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_ingest_config_refuses_a_second_manifest_and_a_ratio_split(mlperf, tmp_path, capsys):
    config = _datasets_config(mlperf, tmp_path, {"cc12m": ([0], "train")})
    out = str(tmp_path / "out")
    assert main(["ingest", "--config", str(config), "--output-dir", out, "--manifest", "x.uri"]) == 2
    assert "remove --manifest" in capsys.readouterr().err
    assert main(["ingest", "--config", str(config), "--output-dir", out, "--train-split", "0.5"]) == 2
    assert "the datasets give the splits (each its split_name): remove --train-split" in capsys.readouterr().err
    assert main(["ingest", "--output-dir", out]) == 2
    assert "nothing to ingest: pass --manifest, or --config with a datasets list" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
