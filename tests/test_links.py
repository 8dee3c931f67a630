"""Nothing is written, renamed or removed through a symbolic link inside an output (``diffprep.validation.ownership``).

Every layout's dataset is written once; then, one case at a time, a folder of it, or one file in each of its
folders, is replaced by a link to a copy outside the output, and the run is made again with every answer. The
copies outside are compared byte for byte after each run, and every link must still point where it did.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from flow_runs import tree
from scene_render import render
from test_ltx2_pipeline import settings_for as ltx_settings
from test_ltx2_pipeline import write_dataset
from test_ingest import mlperf  # noqa: F401 - a fixture
from test_t2i_mirror import hub  # noqa: F401 - a fixture: the stand-in hub
from test_ownership import image_settings, images, never_ask  # noqa: F401 - images is a fixture

from diffprep import contract
from diffprep.config import load_settings
from diffprep.errors import ExistingOutputError, LinkInOutputError
from diffprep.validation.ownership import classify
from diffprep.phases.pipeline import run

# A run of a layout: (the output folder, on_existing, whether with other settings than the first run) -> result.
Again = Callable[[Path, "str | None", bool], object]


def link_cases(root: Path) -> list[str]:
    """The paths a case replaces by a link: every folder below ``root``, and the first file of every folder."""
    folders = sorted(p for p in root.rglob("*") if p.is_dir())
    cases = [p.relative_to(root).as_posix() for p in folders]
    for folder in [root, *folders]:
        files = sorted(p for p in folder.iterdir() if p.is_file())
        if files:
            cases.append(files[0].relative_to(root).as_posix())
    return cases


def plant_link(root: Path, relative: str, outside: Path) -> Path:
    """Move ``root/relative`` to ``outside`` and put a link to it in its place; the link's target."""
    target = outside / relative.replace("/", "__")
    shutil.move(root / relative, target)
    os.symlink(target, root / relative)
    return target


def untouched(root: Path, relative: str, target: Path, before: dict[str, str]) -> None:
    assert (root / relative).is_symlink() and os.readlink(root / relative) == str(target), relative
    assert tree(target.parent) == before, f"written through the link {relative}"


def every_answer_leaves_the_links_alone(dataset: Path, out_of: Callable[[Path], Path], again: Again,
                                        tmp_path: Path) -> None:
    """``dataset``: a finished dataset folder (``out_of(folder)``: its output inside a copy of it); every case of
    ``link_cases`` with the answers that write (same settings: resume; other settings: overwrite, resume) refused
    naming the link, then one case with new-dir, reuse and abort."""
    cases = link_cases(out_of(dataset))
    assert len(cases) >= 4, cases
    for number, relative in enumerate(cases):
        copy, outside = tmp_path / f"case{number}", tmp_path / f"outside{number}"
        shutil.copytree(dataset, copy, symlinks=True)
        outside.mkdir()
        root = out_of(copy)
        target = plant_link(root, relative, outside)
        before = tree(outside)
        for answer, other in ((None, False), ("overwrite", False), ("overwrite", True), ("resume", True)):
            # Same settings write at every link of these cases; other settings may not (an LTX run without audio
            # writes no audio latents), but their trainer would read through it: refused all the same.
            named = rf"`{relative}` -> {target}.*symbolic link" if not other else rf"`{relative}`|other settings"
            with pytest.raises(ExistingOutputError, match=named):
                again(copy, answer, other)
            untouched(root, relative, target, before)
        if number:
            shutil.rmtree(copy)
            continue
        # The first case (a folder of the dataset a link): the answers that write nothing there go on.
        with pytest.raises(ExistingOutputError, match="on_existing=abort"):
            again(copy, "abort", True)
        assert again(copy, "reuse", True).action == "reuse"
        result = again(copy, "new-dir", True)
        assert Path(result.out_dir) == root.with_name(root.name + "-v2") and result.samples
        untouched(root, relative, target, before)


def test_a_link_is_foreign_and_blocks_where_the_run_writes(make_plan, write_unit, tmp_path) -> None:
    plan = make_plan((4, 4))
    manifests = {0: write_unit(tmp_path / "out", plan, 0)}
    links = ["000000.tar", "000001.tar.idx", "empty_encodings", ".nv-meta", ".nv-meta/dataset.yaml",
             ".diffprep/sanity", ".diffprep/notes", "notes", "photos/000000.tar", "extra.txt"]
    owned = classify(["000000.tar.idx", "README.md"], manifests, plan, links)
    assert set(owned.foreign) == {*links, "README.md"} and owned.ours == ("000000.tar.idx",)
    in_the_way = ["000000.tar", "000001.tar.idx", "empty_encodings", ".nv-meta", ".nv-meta/dataset.yaml",
                  ".diffprep/sanity", ".diffprep/notes"]
    assert owned.links_in_the_way(plan) == sorted(in_the_way)
    assert owned.blocking(plan) == sorted(in_the_way)


@pytest.mark.user_path
def test_the_users_command_leaves_a_linked_folder_of_empty_encodings_alone(tmp_path, images) -> None:
    """The report's case, typed in a fresh terminal: ``empty_encodings`` a link to another dataset's, every answer."""
    from user_shell import Terminal

    term = Terminal(tmp_path / "work", tmp_path / "prefect-home")
    term.run("diffprep tiny-model ./tiny-flux").ok()
    shared, out = term.cwd / "shared", term.cwd / "out"
    shared.mkdir()
    out.mkdir()
    (shared / contract.T5_EMPTY).write_bytes(b"another dataset's empty encodings")
    os.symlink(shared, out / contract.EMPTY_ENCODINGS_DIR)
    command = (f"diffprep encode --source-type directory --input-dir {images} --output-dir out "
               "--model-path ./tiny-flux --image-size 32 --t5-max-length 16 --device cpu --precision fp32 "
               "--min-psnr 0 --on-existing ")
    for answer in ("overwrite", "resume", "abort"):
        term.run(command + answer).refused("`empty_encodings` -> " if answer != "abort" else "aborted")
        assert [p.name for p in shared.iterdir()] == [contract.T5_EMPTY]
        assert (shared / contract.T5_EMPTY).read_bytes() == b"another dataset's empty encodings"
    term.run(command + "reuse").refused("cannot reuse", "holds no diffprep plan")
    term.run(command + "new-dir").ok().says("validation: passed")
    assert sorted(os.listdir(out)) == [contract.EMPTY_ENCODINGS_DIR] and (term.cwd / "out-v2").is_dir()
    assert (shared / contract.T5_EMPTY).read_bytes() == b"another dataset's empty encodings"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["energon", "fastgen", "raw", "edm-zip"])
def test_no_answer_writes_through_a_link_in_an_image_layout(layout, tmp_path, images, tiny_model,
                                                            settings_for) -> None:
    encoding = "raw" if layout in ("raw", "edm-zip") else "preencoded"
    output = {} if layout == "raw" else {"layout": layout}
    sections = {"model": {"negative_prompt": "blurry"}} if layout == "fastgen" else {}
    if layout == "edm-zip":
        sections["raw"] = {"image_format": "png"}
    dataset = tmp_path / "dataset"
    assert run(image_settings(settings_for, dataset / "out", images, tiny_model, output, **sections), encoding,
               ask=never_ask).samples == 4

    def again(folder: Path, answer: str | None, other: bool):
        image = {"image_size": 64} if other else {}
        settings = image_settings(settings_for, folder / "out", images, tiny_model,
                                  {**output, "on_existing": answer}, image=image, **sections)
        return run(settings, encoding, ask=never_ask)

    every_answer_leaves_the_links_alone(dataset, lambda folder: folder / "out", again, tmp_path)


@pytest.mark.slow
def test_no_answer_writes_through_a_link_in_the_ltx_layout(tiny_ltx2, tmp_path) -> None:
    dataset = tmp_path / "dataset"
    write_dataset(dataset, {"a.mp4": {}, "b.mp4": {}})

    def again(folder: Path, answer: str | None, other: bool):
        video = {"skip_audio": True} if other else {}
        listing = folder / "dataset.json"
        settings = ltx_settings(folder, listing, tiny_ltx2, output={"layout": "ltx", "on_existing": answer},
                                video=video)
        return run(settings, "preencoded", ask=never_ask)

    assert again(dataset, None, False).samples == 2
    every_answer_leaves_the_links_alone(dataset, lambda folder: folder / contract.PRECOMPUTED_DIR, again, tmp_path)

    # The .precomputed folder itself a link, inside the --output-dir the user named.
    outside = tmp_path / "elsewhere"
    shutil.move(dataset / contract.PRECOMPUTED_DIR, outside)
    os.symlink(outside, dataset / contract.PRECOMPUTED_DIR)
    before = tree(outside)
    with pytest.raises(LinkInOutputError, match=rf"`{contract.PRECOMPUTED_DIR}` -> {outside}"):
        again(dataset, "overwrite", True)
    assert tree(outside) == before


def test_no_answer_writes_through_a_link_in_the_gae_layout(tmp_path) -> None:
    inp, dataset = tmp_path / "in", tmp_path / "dataset"
    for scene in ("s0", "s1"):
        render(inp, "mvssynth", scene=scene, frames=6)

    def again(folder: Path, answer: str | None, other: bool):
        return run(load_settings(overrides={
            "source": {"type": "scenes", "input_dir": str(inp), "scene_format": "mvssynth"},
            "output": {"output_dir": str(folder / "out"), "layout": "gae", "on_existing": answer},
            "scenes": {"frames": 5, "resolution": 48 if other else 32}, "image": {"decode_workers": 1}}),
            "raw", ask=never_ask)

    assert again(dataset, None, False).samples == 2
    every_answer_leaves_the_links_alone(dataset, lambda folder: folder / "out", again, tmp_path)


@pytest.mark.parametrize(("command", "linked"), [
    ("finalize", "000000.tar.idx"),  # Energon's prepare writes the indexes and .nv-meta itself: refused before it
    ("finalize", contract.NV_META),
    ("finalize", f"{contract.NV_META}/{contract.SPLIT_YAML}"),
    ("validate", contract.STATE_DIR),
    ("validate", f"{contract.STATE_DIR}/{contract.VALIDATION_JSON}"),
    ("latent-stats", contract.STATE_DIR),
    ("ignore-list", contract.STATE_DIR),
    ("ignore-list", "ignore_index.json"),
])
def test_a_command_over_a_written_dataset_refuses_a_link_where_it_writes(command, linked, tmp_path, images,
                                                                         tiny_model, settings_for, capsys) -> None:
    from diffprep.cli import main

    out, outside = tmp_path / "out", tmp_path / "outside"
    assert run(image_settings(settings_for, out, images, tiny_model, {}), "preencoded", ask=never_ask).samples == 4
    (out / "ignore_index.json").write_text("{}\n")  # a list of the user's, for the file link
    outside.mkdir()
    target = plant_link(out, linked, outside)
    before = tree(outside)
    extra = {"finalize": ["--replace-split"]}.get(command, [])
    assert main([command, str(out), *extra]) != 0
    assert f"`{linked}` -> {target}" in capsys.readouterr().err
    untouched(out, linked, target, before)


def test_no_answer_writes_through_a_link_in_an_ingested_dataset(mlperf, tmp_path, capsys) -> None:
    """``diffprep ingest``: every folder of an ingested dataset, and a file of each, a link in turn."""
    from test_ingest import _args

    from diffprep.cli import main

    dataset = tmp_path / "dataset"
    assert main(_args(mlperf, dataset / "out")) == 0
    for number, relative in enumerate(link_cases(dataset / "out")):
        copy, outside = tmp_path / f"case{number}", tmp_path / f"outside{number}"
        shutil.copytree(dataset, copy, symlinks=True)
        outside.mkdir()
        target = plant_link(copy / "out", relative, outside)
        before = tree(outside)
        for answer in ("overwrite", "resume", "new-dir" if not number else "abort"):
            main(_args(mlperf, copy / "out", "--on-existing", answer))
            untouched(copy / "out", relative, target, before)
        assert f"`{relative}` -> {target}" in capsys.readouterr().err


def test_a_t2i_pack_refuses_a_link_where_it_writes(tmp_path) -> None:
    """``diffprep t2i imagenet``: its folder, state folder and shards, each a link in turn, with a pack again."""
    from class_folders import write_class_folders

    from diffprep.tools.t2i import pack_imagenet

    source = write_class_folders(tmp_path / "train", {"a": 3, "b": 3})
    split = contract.T2I_SPLIT_FOLDERS["imagenet"]
    dataset = tmp_path / "dataset"
    pack_imagenet(str(source), str(dataset / split), shard_size=2, seed=1)
    cases = link_cases(dataset / split)
    assert {contract.STATE_DIR, f"{contract.STATE_DIR}/{contract.UNITS_DIR}", "imagenet_00000.tar"} <= set(cases)
    for number, relative in enumerate(cases):
        copy, outside = tmp_path / f"case{number}", tmp_path / f"outside{number}"
        shutil.copytree(dataset, copy, symlinks=True)
        outside.mkdir()
        target = plant_link(copy / split, relative, outside)
        before = tree(outside)
        for extra in ({}, {"a": 2}):  # complete, then grown: an append writes new shards beside
            if extra:
                write_class_folders(tmp_path / "train", {"a": 3 + extra["a"], "b": 3})
            with pytest.raises(LinkInOutputError, match=rf"`{relative}` -> {target}"):
                pack_imagenet(str(source), str(copy / split), shard_size=2, seed=1)
            untouched(copy / split, relative, target, before)
        write_class_folders(tmp_path / "train", {"a": 3, "b": 3})


def test_the_blip3o_mirror_refuses_a_linked_split_folder(tmp_path, hub, monkeypatch) -> None:
    from diffprep.tools.t2i_mirror import mirror_blip3o, parse_repo_overrides

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    overrides = parse_repo_overrides(["long=Org/Long"])
    folder, outside = contract.T2I_SPLIT_FOLDERS["long"], tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "00000.tar").write_bytes(b"someone else's, cut short")
    (tmp_path / "out").mkdir()
    os.symlink(outside, tmp_path / "out" / folder)
    before = tree(outside)
    with pytest.raises(LinkInOutputError, match=rf"`{folder}` -> {outside}"):
        mirror_blip3o(str(tmp_path / "out"), ["long"], overrides, endpoint=hub)
    assert tree(outside) == before
    # A tar of the split a link (to a cut file): never replaced through it, nor the link replaced.
    (tmp_path / "out" / folder).unlink()
    (tmp_path / "out" / folder).mkdir()
    os.symlink(outside / "00000.tar", tmp_path / "out" / folder / "00000.tar")
    with pytest.raises(LinkInOutputError, match=rf"`{folder}/00000.tar` -> {outside}/00000.tar"):
        mirror_blip3o(str(tmp_path / "out"), ["long"], overrides, endpoint=hub)
    assert tree(outside) == before and (tmp_path / "out" / folder / "00000.tar").is_symlink()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["energon", "fastgen", "raw", "edm-zip"])
def test_an_overwrite_keeps_foreign_files_and_links_out_of_its_way(layout, tmp_path, images, tiny_model,
                                                                   settings_for) -> None:
    """Foreign files and links at names this run never writes, in every folder diffprep's state is not: the
    overwrite goes on, removes only what diffprep's records name, and keeps every file, every link and every
    link's target as they were."""
    from test_ownership import answers_keep_foreign_files, plant

    encoding = "raw" if layout in ("raw", "edm-zip") else "preencoded"
    output = {} if layout == "raw" else {"layout": layout}
    sections = {"raw": {"image_format": "png"}} if layout == "edm-zip" else {}
    out, outside = tmp_path / "out", tmp_path / "outside"
    assert run(image_settings(settings_for, out, images, tiny_model, output, **sections), encoding,
               ask=never_ask).samples == 4
    planted = plant(out, {".nv-meta/custom/keep.yaml": b"mine: true\n"})
    outside.mkdir()
    (outside / "target.txt").write_bytes(b"someone else's")
    links = [folder / "user-link" for folder in [out, *out.rglob("*")]
             if folder.is_dir() and not folder.is_symlink() and contract.STATE_DIR not in folder.relative_to(out).parts]
    for link in links:
        os.symlink(outside / "target.txt", link)
    assert len(links) >= 3

    def again(answer):
        return run(image_settings(settings_for, out, images, tiny_model, {**output, "on_existing": answer},
                                  image={"image_size": 64}, **sections), encoding, ask=never_ask)

    answers_keep_foreign_files(out, again, planted, tmp_path / "out-v2")
    assert all(link.is_symlink() and os.readlink(link) == str(outside / "target.txt") for link in links)
    assert tree(outside) == {"target.txt": tree(outside)["target.txt"]}
    assert (outside / "target.txt").read_bytes() == b"someone else's"
