"""Caption sets through the library: the caption run's phases with the OpenAI-compatible stand-in server
(tests/openai_standin.py, a real HTTP server on 127.0.0.1), resume, a split across workers, the overwrite question,
the LTX trainer's metadata file, and an encode reading a set (``--caption-set``) with its over-long question."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from diffprep.captions.pipeline import CaptionJob
from diffprep.captions.run import CaptionEvents, ask_here, run_caption
from diffprep.captions.sets import CAPTIONS_JSONL, CaptionSet
from diffprep.config import SourceConfig, load_settings
from diffprep.errors import DiffprepError
from diffprep.run.approvals import ApprovalRefused
from diffprep.sources import open_source
from diffprep.sources.metadata import MetadataSource
from openai_standin import OpenAIStandin
from test_video import write_clip

INSTRUCTION = "Describe it in one sentence."


@pytest.fixture(scope="module")
def standin_url() -> str:
    """The stand-in OpenAI-compatible server (tests/openai_standin.py) serving a model named ``standin``."""
    with OpenAIStandin(model="standin") as server:
        yield server.url


def media_folder(root: Path) -> Path:
    """images/ (three flat colours and a file that is no image) and videos/ (one short clip), no captions/."""
    (root / "images").mkdir(parents=True)
    (root / "videos").mkdir()
    for name, colour in (("red", (255, 0, 0)), ("green", (0, 255, 0)), ("blue", (0, 0, 255))):
        Image.new("RGB", (32, 24), colour).save(root / "images" / f"{name}.png")
    (root / "images" / "broken.png").write_bytes(b"not a png")
    (root / "videos" / "clip.mp4").write_bytes(write_clip(frames=12, fps=6, audio=None))
    return root


def job_for(data: Path, url: str, name: str = "v1", **fields) -> CaptionJob:
    captioning = {"model": "standin", "server_url": url, "batch_size": 2} | fields.pop("captioning", {})
    return CaptionJob(name=name, source=SourceConfig(type="directory", input_dir=str(data)), captioning=captioning,
                      instructions=fields.pop("instructions", [INSTRUCTION]), unit_size=2, **fields)


def set_bytes(path: Path) -> dict[str, str]:
    """The set's captions, by file: every unit and the listing (the index is SQLite, its bytes are its own)."""
    files = sorted((path / "units").glob("*.jsonl")) + [path / CAPTIONS_JSONL]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


class StopAfterFirstUnit(CaptionEvents):
    def unit_done(self, result: dict) -> None:
        raise KeyboardInterrupt


def test_a_set_is_the_same_after_a_crash_and_whatever_the_split(tmp_path: Path, standin_url: str) -> None:
    one = media_folder(tmp_path / "one")
    result = run_caption(job_for(one, standin_url))
    assert (result["action"], result["samples"], result["units"]) == ("fresh", 5, 3)
    audit = result["audit"]
    assert (audit["samples"], audit["captioned"], audit["rejected"], sum(audit["by_reason"].values())) == (5, 4, 1, 1)
    cset = CaptionSet(str(one / ".captions" / "v1"))
    rows = [json.loads(line) for line in (Path(cset.path) / CAPTIONS_JSONL).read_text().splitlines()]
    assert [r["media_path"] for r in rows] == ["images/blue.png", "videos/clip.mp4", "images/green.png",
                                               "images/red.png"]  # the source's order: its ids sorted
    assert all(r["caption"] and r["captions"] == [r["caption"]] for r in rows)
    record = cset.record()
    assert record["settings"]["captioning"][0]["instruction"] == INSTRUCTION and record["captioner"]["model"] == "standin"
    assert (Path(cset.path) / "sanity" / "frames.png").is_file()
    # The reject is named, with the decoder's reason, in its unit.
    rejects = [r for u in range(3) for r in cset.unit_records(u) if "reject" in r]
    assert [r["source_id"] for r in rejects] == ["broken.png"] and rejects[0]["reject"]["reason"]

    # Interrupted after its first unit, then run again: the committed unit is kept, the set is the same.
    crashed = media_folder(tmp_path / "crashed")
    with pytest.raises(KeyboardInterrupt):
        run_caption(job_for(crashed, standin_url), events=StopAfterFirstUnit())
    assert not CaptionSet(str(crashed / ".captions" / "v1")).is_written()
    resumed = run_caption(job_for(crashed, standin_url))
    assert (resumed["action"], resumed["captioned_units"]) == ("resume", 2)
    assert set_bytes(crashed / ".captions" / "v1") == set_bytes(one / ".captions" / "v1")

    # Two worker processes share the units (this process's --device is not one of theirs, so it captions none;
    # the server's captioner never uses it): the same bytes as one process.
    split = media_folder(tmp_path / "split")
    workers: list[str] = []

    class Workers(CaptionEvents):
        def unit_done(self, result: dict) -> None:
            workers.append(result["worker"])

    run_caption(job_for(split, standin_url, devices="cpu:2", device="cuda"), events=Workers())
    assert len(workers) == 3 and not any(w.startswith("this process") for w in workers)
    assert set_bytes(split / ".captions" / "v1") == set_bytes(one / ".captions" / "v1")
    assert CaptionSet(str(split / ".captions" / "v1")).record()["digest"] == record["digest"]

    # The same command again: the written set is reused as it is.
    assert run_caption(job_for(one, standin_url))["action"] == "reuse"


def test_a_set_with_other_settings_is_replaced_only_when_answered(tmp_path: Path, standin_url: str) -> None:
    data = media_folder(tmp_path / "data")
    run_caption(job_for(data, standin_url))
    before = set_bytes(data / ".captions" / "v1")
    other = job_for(data, standin_url, instructions=[INSTRUCTION, "List the colours."])
    with pytest.raises(ApprovalRefused, match="exists with other settings"):
        run_caption(other, ask=ask_here)  # no terminal here: the safe choice, nothing changed
    assert set_bytes(data / ".captions" / "v1") == before
    assert sorted(p.name for p in (data / ".captions").iterdir()) == ["v1"]  # nothing of the refused run
    # Another name keeps the first set; two instructions: two captions per sample.
    kept = run_caption(job_for(data, standin_url, name="v2", instructions=[INSTRUCTION, "List the colours."]))
    assert kept["action"] == "fresh" and set_bytes(data / ".captions" / "v1") == before
    rows = [json.loads(line) for line in (data / ".captions" / "v2" / CAPTIONS_JSONL).read_text().splitlines()]
    assert all(len(r["captions"]) == 2 and r["captions"][0] != r["captions"][1] for r in rows)
    # Files the set's folders hold that a caption run does not write, and links in every folder: the question
    # names them, and an overwrite keeps them (and never writes or removes through a link).
    v1 = data / ".captions" / "v1"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("theirs")
    (v1 / "notes.md").write_text("mine")
    (v1 / "units" / "review.txt").write_text("mine too")
    (v1 / "link-dir").symlink_to(outside)
    (v1 / "units" / "000099.jsonl").symlink_to(outside / "keep.txt")  # a link at a name the set would own
    (v1 / "units" / "000000.jsonl.bak").write_text("a copy of a unit, named like one")
    (v1 / "sanity").mkdir(exist_ok=True)
    (v1 / "sanity" / "mine.png").write_bytes(b"not the run's")
    (v1 / "sanity" / "link").symlink_to(outside)
    cset = CaptionSet(str(v1))
    assert cset.listing()[1] == ["link-dir", "notes.md", "sanity/link", "sanity/mine.png", "units/000000.jsonl.bak",
                                 "units/000099.jsonl", "units/review.txt"]
    with pytest.raises(ApprovalRefused, match="7 other file"):
        run_caption(other, ask=ask_here)
    # Answered ahead of time: replaced.
    replaced = run_caption(job_for(data, standin_url, on_existing="overwrite",
                                   instructions=["List the colours."]))
    assert replaced["action"] == "overwrite" and set_bytes(data / ".captions" / "v1") != before
    assert (v1 / "notes.md").read_text() == "mine" and (v1 / "units" / "review.txt").read_text() == "mine too"
    assert (v1 / "link-dir").is_symlink() and (v1 / "units" / "000099.jsonl").is_symlink()
    assert (v1 / "sanity" / "mine.png").read_bytes() == b"not the run's" and (v1 / "sanity" / "link").is_symlink()
    assert (v1 / "units" / "000000.jsonl.bak").read_text() == "a copy of a unit, named like one"
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"] and (outside / "keep.txt").read_text() == "theirs"


def test_the_ltx_metadata_file_reads_as_the_ltx_trainer_reads_it(tmp_path: Path, standin_url: str) -> None:
    data = media_folder(tmp_path / "data")
    result = run_caption(job_for(data, standin_url, ltx_metadata=str(data / "dataset.json")))
    listed = {r["media_path"]: r["caption"] for r in map(json.loads, (
        data / ".captions" / "v1" / CAPTIONS_JSONL).read_text().splitlines())}
    # The metadata source reads a file by the LTX trainer's rules (caption / media_path, relative to the file).
    source = MetadataSource(result["ltx_metadata"])
    samples = list(source.read(list(source.list_ids())))
    assert len(samples) == 4 and all(s.reject is None for s in samples)
    for sample in samples:
        relative = "videos/clip.mp4" if sample.video is not None else f"images/{sample.source_id.rsplit('/', 1)[-1]}"
        assert sample.caption == listed[relative]
        assert sample.media == (data / relative).read_bytes()
    # The same file again: nothing to ask. Over a file that differs: only when answered.
    run_caption(job_for(data, standin_url, ltx_metadata=str(data / "dataset.json")))
    (data / "dataset.json").write_text("[]")
    with pytest.raises(ApprovalRefused, match="LTX metadata file"):
        run_caption(job_for(data, standin_url, ltx_metadata=str(data / "dataset.json")))
    run_caption(job_for(data, standin_url, ltx_metadata=str(data / "dataset.json"), on_replace_files="replace"))


def test_encode_reads_a_caption_set_and_asks_about_long_captions(tmp_path: Path, standin_url: str,
                                                                 tiny_model: Path) -> None:
    from diffprep import contract
    from diffprep.cli.caption import long_caption_overrides
    from diffprep.phases.pipeline import run

    data = media_folder(tmp_path / "data")
    run_caption(job_for(data, standin_url, count_tokens={"flux": str(tiny_model)}))
    set_path = data / ".captions" / "v1"
    tokens = CaptionSet(str(set_path)).record()["tokens"]["flux"]
    assert tokens["samples"] == 4 and tokens["limit"] == 512 and tokens["over"] == 0 and tokens["longest"] > 3

    overrides = {"source": {"type": "directory", "input_dir": str(data), "caption_set": "v1"},
                 "output": {"output_dir": str(tmp_path / "out"), "shard_size": 8, "accept_rejects": 1.0},
                 "image": {"image_size": 32, "decode_workers": 1}, "finalize": {"enabled": False}}
    # Without the set the folder has no captions/: refused by the directory source.
    with pytest.raises(DiffprepError, match="no captions/ folder"):
        open_source(load_settings(overrides={**overrides, "source": {"input_dir": str(data)}}).source)
    result = run(load_settings(overrides=overrides), contract.ENCODING_RAW)
    assert (result.samples, result.rejected) == (3, 2)  # the clip in an image run, and the broken file
    with tarfile.open(tmp_path / "out" / "000000.tar") as tar:
        stored = {json.loads(tar.extractfile(f"{m.name[:-4]}.meta.json").read())["source_id"]:
                  tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")}
    listed = {r["source_id"]: r["caption"] for r in map(json.loads, (set_path / CAPTIONS_JSONL).read_text().splitlines())}
    assert stored == {sid: listed[sid] for sid in stored} and len(stored) == 3

    # A Flux encode that keeps fewer tokens than the captions have: asked, never cut silently.
    flux = load_settings(overrides={**overrides, "model": {"model_path": str(tiny_model), "t5_max_length": 3}})
    with pytest.raises(ApprovalRefused, match="4 captions are longer than flux"):
        long_caption_overrides(flux, {})
    rejecting = long_caption_overrides(flux.model_copy(update={"source": flux.source.model_copy(
        update={"on_long_caption": "reject"})}), {})
    assert rejecting["source"]["caption_reject_over"] == "flux:3"
    source = open_source(flux.source.model_copy(update={"caption_reject_over": "flux:3"}))
    read = list(source.read(["blue.png", "clip.mp4"]))
    assert [s.reject.reason for s in read] == ["caption_too_long", "caption_too_long"]
    from diffprep.sources.base import caption_settings

    assert caption_settings(source_cfg := flux.source)["caption_set"]["digest"] == CaptionSet(str(set_path)).record()[
        "digest"]
    assert caption_settings(source_cfg.model_copy(update={"caption_reject_over": "flux:3"})) != caption_settings(
        source_cfg)  # rejecting over-long captions is another dataset: another fingerprint
    assert long_caption_overrides(flux.model_copy(update={"source": flux.source.model_copy(
        update={"on_long_caption": "truncate"})}), {}) == {"source": {"on_long_caption": "truncate"}}

    # A set captioned without --count-tokens: the encode counts its captions with its own tokenizer, and asks.
    run_caption(job_for(data, standin_url, name="uncounted"))
    assert "flux" not in (CaptionSet(str(data / ".captions" / "uncounted")).record().get("tokens") or {})
    uncounted = flux.model_copy(update={"source": flux.source.model_copy(update={"caption_set": "uncounted"})})
    with pytest.raises(ApprovalRefused, match="4 captions are longer than flux"):
        long_caption_overrides(uncounted, {})

    # A flow run (a deployment, the UI) asks through the run's own ``ask`` before it plans: nothing is cut unasked.
    asked = []

    def ask(question, preset=None, *, release=False):
        asked.append(question.key)
        return "abort"

    plan_json = tmp_path / "out" / contract.STATE_DIR / contract.PLAN_JSON
    before = plan_json.read_bytes()
    with pytest.raises(DiffprepError, match="over 3 flux tokens: aborted, nothing encoded"):
        run(flux, contract.ENCODING_PREENCODED, ask=ask)
    assert asked == ["captions-too-long"] and plan_json.read_bytes() == before  # asked before anything was planned


def test_a_set_that_is_not_written_is_refused_by_name(tmp_path: Path) -> None:
    data = media_folder(tmp_path / "data")
    settings = load_settings(overrides={"source": {"type": "directory", "input_dir": str(data), "caption_set": "nope"}})
    with pytest.raises(DiffprepError, match="diffprep caption --name nope"):
        open_source(settings.source)


def test_torchrun_ranks_share_the_units_and_write_the_same_set(tmp_path: Path, standin_url: str) -> None:
    """`torchrun --nproc_per_node 2 -m diffprep caption ...`: rank 0 plans, checks and writes, rank 1 captions
    its units (u % 2 == 1); the set is the one a single process writes."""
    import socket
    import subprocess
    import sys

    from user_shell import terminal_env

    one = media_folder(tmp_path / "one")
    run_caption(job_for(one, standin_url))
    ranked = media_folder(tmp_path / "ranked")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
               "-m", "diffprep", "caption", "--input-dir", str(ranked), "--name", "v1", "--server-url", standin_url,
               "--caption-model", "standin", "--batch-size", "2", "--unit-size", "2", "--instruction", INSTRUCTION]
    done = subprocess.run(command, env=terminal_env(tmp_path / "prefect-home"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1: captioned units 000001" in done.stdout and "captioned: 4   rejected: 1" in done.stdout
    assert set_bytes(ranked / ".captions" / "v1") == set_bytes(one / ".captions" / "v1")


def test_the_flow_on_a_prefect_server_runs_its_tasks_and_shows_the_sanity_sample(
        prefect_server, tmp_path: Path, standin_url: str) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterId)
    from prefect.client.schemas.objects import StateType

    from diffprep.flows.caption import caption_dataset, job_to_json

    data = media_folder(tmp_path / "data")
    state = caption_dataset(job_to_json(job_for(data, standin_url)), return_state=True)
    assert state.type == StateType.COMPLETED and state.result()["audit"]["captioned"] == 4
    with get_client(sync_client=True) as client:
        run_id = state.state_details.flow_run_id
        artifacts = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))}
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    assert "data:image/png;base64," in artifacts["caption-sanity-v1"].data  # the sample's frames, shown
    assert artifacts["caption-audit-v1"].description == "4 captioned, 1 rejected of 5"
    assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == [  # a task run per phase and per unit
        "caption-audit", "caption-plan", "caption-prepare", "caption-sanity", "caption-unit", "caption-unit",
        "caption-unit", "caption-verify", "caption-write"]


def test_caption_files_are_written_on_request_and_read_by_the_directory_source(tmp_path: Path,
                                                                              standin_url: str) -> None:
    data = media_folder(tmp_path / "data")
    run_caption(job_for(data, standin_url))
    assert not (data / "captions").exists()  # not asked for: none written
    assert run_caption(job_for(data, standin_url, caption_files=True))["caption_files"] == 4
    listed = {r["source_id"]: r["caption"] for r in map(json.loads, (
        data / ".captions" / "v1" / CAPTIONS_JSONL).read_text().splitlines())}
    source = open_source(SourceConfig(type="directory", input_dir=str(data)))
    read = {s.source_id: s.caption for s in source.read(list(source.list_ids())) if s.reject is None}
    assert read == listed
    assert run_caption(job_for(data, standin_url, caption_files=True))["caption_files"] == 4  # the same: not asked
    (data / "captions" / "red.txt").write_text("my own caption")
    with pytest.raises(ApprovalRefused, match="caption files: 1 file"):
        run_caption(job_for(data, standin_url, caption_files=True))
    assert (data / "captions" / "red.txt").read_text() == "my own caption"
