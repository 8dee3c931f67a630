"""Which files diffprep wrote (``diffprep.validation.ownership``), and every answer to the existing-output question keeping the
files it did not write byte for byte, in every layout: energon, fastgen, raw, edm-zip, the LTX trainer's .precomputed/
and GAE's scene folders."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from flow_runs import tree
from scene_render import render
from test_ltx2_pipeline import settings_for as ltx_settings
from test_ltx2_pipeline import write_dataset

from diffprep import contract
from diffprep.tools.demo import write_demo_dataset
from diffprep.errors import ExistingOutputError
from diffprep.validation.ownership import classify
from diffprep.config import load_settings
from diffprep.phases.pipeline import run

PLANTED = "planted-by-user.txt"


def never_ask(question, preset=None, *, release=False):
    pytest.fail(f"asked {question.key}: {question.title}")


# --- classify: the rules, file by file ---------------------------------------------------------------------------


def test_only_what_manifests_plans_and_names_give_is_ours(make_plan, write_unit, tmp_path) -> None:
    plan = make_plan((4, 4))
    out = tmp_path / "out"
    manifests = {0: write_unit(out, plan, 0)}
    files = [
        "000000.tar", "000000.tar.idx",  # a manifest's shard and its index
        "000001.tar",  # planned, no manifest (a unit that died after its shard): the plan names it
        "000002.tar", "000002.tar.idx",  # shard-shaped, but neither listed nor planned
        ".nv-meta/dataset.yaml", ".nv-meta/split.yaml", ".nv-meta/.info.json", ".nv-meta/index.sqlite",
        ".nv-meta/index.uuid", ".nv-meta/custom/keep.yaml", ".nv-meta/notes.md",
        "empty_encodings/t5_empty.npy", "empty_encodings/clip_empty.npy", "empty_encodings/user_note.txt",
        "neg_prompt_emb.npy", "shard_counts.json", "ignore_index.json", ".diffprep/ignore_report.json",
        "notes/neg_prompt_emb.npy",
        ".diffprep/plan.json", ".diffprep/units/000000.json", ".diffprep/units/README", ".diffprep/audit.json",
        ".diffprep/sanity/report.json", ".diffprep/sanity/anything.png", ".diffprep/tmp/000003.tar.h.1.tmp",
        ".diffprep/text_cache/abc/" + "e" * 64 + ".pt", ".diffprep/text_cache/abc/x.pt", ".diffprep/lock.json", ".diffprep/lock-shard-0002.json",
        ".diffprep/my-notes.txt", ".diffprep/rejects_answer.json", ".diffprep/downloads/data-00001.arrow.part",
        # atomic writes' temporary names, host names with dots included
        ".nv-meta/.dataset.yaml.node-1.cluster.example.42.tmp", ".my.file.host.7.tmp",
        "README.md", "extra/000000.tar",
    ]
    owned = classify(files, manifests, plan)
    assert owned.locks == (".diffprep/lock-shard-0002.json", ".diffprep/lock.json")
    assert set(owned.foreign) == {
        "000002.tar", "000002.tar.idx", ".nv-meta/custom/keep.yaml", ".nv-meta/notes.md",
        "empty_encodings/user_note.txt", "notes/neg_prompt_emb.npy", ".diffprep/units/README",
        ".diffprep/my-notes.txt", ".my.file.host.7.tmp", "README.md", "extra/000000.tar",
        ".diffprep/sanity/anything.png", ".diffprep/text_cache/abc/x.pt"}
    assert set(owned.ours) == set(files) - set(owned.foreign) - set(owned.locks)
    # This run writes 000002.tar too (a plan of three units): a foreign file of that name blocks an overwrite.
    assert owned.blocking(make_plan((4, 4, 2))) == ["000002.tar", "000002.tar.idx"]
    assert owned.blocking(plan) == []


def test_without_a_plan_nothing_shard_named_is_ours(make_plan) -> None:
    owned = classify(["000000.tar", ".nv-meta/dataset.yaml", "notes.txt"], {}, None)
    assert owned.ours == (".nv-meta/dataset.yaml",)
    assert owned.foreign == ("000000.tar", "notes.txt")
    assert owned.blocking(make_plan((4,))) == ["000000.tar"]


# --- every layout, every answer, foreign files in every folder ----------------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("images"), samples=4)


def image_settings(settings_for, out, images, tiny_model, output, **sections):
    return settings_for(out, images, tiny_model, output={"shard_size": 2, "on_existing": None, **output},
                        finalize={"train_split": 1.0}, **sections)


def plant(root: Path, extra: dict[str, bytes]) -> dict[str, bytes]:
    """A file of the user's in every folder of a finished output, and ``extra``; what was planted, by path."""
    planted = dict(extra)
    folders = [root] + [p for p in root.rglob("*") if p.is_dir()]
    for folder in folders:
        planted[(folder / PLANTED).relative_to(root).as_posix()] = f"mine, in {folder.name}\n".encode()
    for relative, data in planted.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return planted


def answers_keep_foreign_files(root: Path, again, planted: dict[str, bytes], other_root: Path) -> None:
    """``again(on_existing)`` runs other settings over ``root``: abort and new-dir change nothing there; overwrite
    replaces diffprep's files only, and every planted file is still there, byte for byte."""
    before = tree(root)
    with pytest.raises(ExistingOutputError, match="on_existing=abort"):
        again("abort")
    assert tree(root) == before

    result = again("new-dir")
    assert Path(result.out_dir) == other_root and result.samples
    assert tree(root) == before

    result = again("overwrite")
    assert Path(result.out_dir) == root and result.validation["ok"]
    after = tree(root)
    assert {path: after.get(path) for path in planted} == {p: hashlib.sha256(d).hexdigest() for p, d in planted.items()}
    replaced = [path for path in before if path not in planted and before[path] != after.get(path)]
    assert replaced, "the overwrite changed nothing diffprep wrote"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["energon", "fastgen", "raw", "edm-zip"])
def test_every_answer_keeps_foreign_files_in_image_layouts(layout, tmp_path, images, tiny_model,
                                                           settings_for) -> None:
    out = tmp_path / "out"
    encoding = "raw" if layout in ("raw", "edm-zip") else "preencoded"
    output = {} if layout == "raw" else {"layout": layout}
    model = {"negative_prompt": "blurry"} if layout == "fastgen" else {}  # its files at the top are diffprep's too
    raw = {"image_format": "png"} if layout == "edm-zip" else {}  # EDM's archive holds PNGs
    assert run(image_settings(settings_for, out, images, tiny_model, output, model=model, raw=raw), encoding,
               ask=never_ask).samples == 4
    planted = plant(out, {".nv-meta/custom/keep.yaml": b"mine: true\n", "notes/000000.tar": b"a shard name, below"})
    if layout == "energon":
        planted["empty_encodings/user_note.txt"] = b"keep me"
        (out / "empty_encodings/user_note.txt").write_bytes(b"keep me")
        assert (out / contract.EMPTY_ENCODINGS_DIR / contract.T5_EMPTY).is_file()

    def again(on_existing):
        settings = image_settings(settings_for, out, images, tiny_model, {**output, "on_existing": on_existing},
                                  model=model, raw=raw, image={"image_size": 64})
        return run(settings, encoding, ask=never_ask)

    answers_keep_foreign_files(out, again, planted, tmp_path / "out-v2")


@pytest.mark.slow
def test_every_answer_keeps_foreign_files_in_the_ltx_layout(tiny_ltx2, tmp_path) -> None:
    data = tmp_path / "dataset"
    listing = write_dataset(data, {"a.mp4": {}, "b.mp4": {}})
    root = data / contract.PRECOMPUTED_DIR

    def settings(on_existing, **video):
        return ltx_settings(data, listing, tiny_ltx2, output={"layout": "ltx", "on_existing": on_existing},
                            video=video)

    assert run(settings(None), "preencoded", ask=never_ask).samples == 2
    records = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.pt")}
    planted = plant(root, {"latents/USER_FILE.txt": b"not a record"})

    # A .pt of the user's in a record folder: the trainer would read it beside the new records, so overwrite is not
    # offered, and refused when given; new-dir still works.
    (root / "latents" / "USER_FILE.pt").write_bytes(b"the trainer globs me")
    with pytest.raises(ExistingOutputError, match=r"cannot overwrite .*`latents/USER_FILE.pt`.*new-dir"):
        run(settings("overwrite", skip_audio=True), "preencoded", ask=never_ask)
    asked = []

    def abort(question, preset=None, *, release=False):
        asked.append(question)
        return question.check("abort")

    with pytest.raises(Exception, match="aborted"):
        run(settings(None, skip_audio=True), "preencoded", ask=abort)
    assert "overwrite" not in asked[0].choices and "`latents/USER_FILE.pt`" in asked[0].description
    (root / "latents" / "USER_FILE.pt").unlink()

    answers_keep_foreign_files(root, lambda answer: run(settings(answer, skip_audio=True), "preencoded",
                                                        ask=never_ask), planted, data / ".precomputed-v2")
    assert not (root / contract.AUDIO_LATENTS_DIR / "a.pt").exists()  # the old run's, gone with its manifest

    # A .precomputed/ the trainer's own tool wrote (no .diffprep/ at all): none of it is diffprep's. Overwrite
    # would write over its records and is refused; every file stays.
    shutil.rmtree(root)
    for relative, data_bytes in records.items():
        if not relative.startswith(contract.STATE_DIR + "/"):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_bytes(data_bytes)
    official = tree(root)
    with pytest.raises(ExistingOutputError, match=r"cannot overwrite .*`latents/a.pt`"):
        run(settings("overwrite"), "preencoded", ask=never_ask)
    assert tree(root) == official


def test_every_answer_keeps_foreign_files_in_the_gae_layout(tmp_path) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    for scene in ("s0", "s1"):
        render(inp, "mvssynth", scene=scene, frames=6)

    def settings(on_existing, resolution=32):
        return load_settings(overrides={
            "source": {"type": "scenes", "input_dir": str(inp), "scene_format": "mvssynth"},
            "output": {"output_dir": str(out), "layout": "gae", "on_existing": on_existing},
            "scenes": {"frames": 5, "resolution": resolution}, "image": {"decode_workers": 1}})

    assert run(settings(None), "raw", ask=never_ask).samples == 2
    planted = plant(out, {"s0/notes.json": b"{}"})
    # A scene folder diffprep did not write: GAE's loader would read it beside the new scenes, so overwrite is refused.
    (out / "s9").mkdir()
    (out / "s9" / "video.mp4").write_bytes(b"a scene of someone else's")
    with pytest.raises(ExistingOutputError, match=r"cannot overwrite .*`s9/video.mp4`.*new-dir"):
        run(settings("overwrite", resolution=48), "raw", ask=never_ask)
    shutil.rmtree(out / "s9")
    answers_keep_foreign_files(out, lambda answer: run(settings(answer, resolution=48), "raw", ask=never_ask),
                               planted, tmp_path / "out-v2")
    assert (out / "s0" / "meta.json").is_file() and (out / "s1" / "video.mp4").is_file()
