"""The user path, scenes and long videos: `diffprep` started as a new process in a fresh terminal
(tests/user_shell.py), each command as the README writes it, over small media these tests write; each dataset
written once, then every command over a written dataset that applies to it, each a new process too.

Datasets: posed scenes (tests/scene_render.py) in GAE's packed layout (RealEstate10K), FastGen's camera shards
(ScanNet++, with depth) and through the Wan set (`encoding: wan_scenes`); long videos with hard cuts split into
clips (`--split-scenes`). The tiny Wan set is the session's (tests/conftest.py).

These assert what a user is promised, not what today's code happens to do: a failure here is a bug on the
user's path (or a README that says something else).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scene_render import render
from user_shell import (Ran, Terminal, decode, finalize, ignore_list, latent_stats, module_terminal, recorded, validate,
                        written)

pytestmark = [pytest.mark.user_path, pytest.mark.slow]


@pytest.fixture(scope="module")
def term(tmp_path_factory) -> Iterator[Terminal]:
    yield from module_terminal(tmp_path_factory, "user-scenes", __name__)


# --- the datasets, each written once ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def re10k_gae(term: Terminal) -> Ran:
    """README, Scenes: RealEstate10K (GAE's transforms.json form) packed as GAE reads it."""
    for scene, caption in (("s0", "a hall"), ("s1", "a kitchen")):
        render(term.cwd / "RealEstate10K", "re10k", scene=scene, frames=8, caption=caption)
    return term.run("diffprep raw --source-type scenes --scene-format re10k --input-dir ./RealEstate10K "
                    "--layout gae --scene-fps 15 --scene-frames 5 --scene-resolution 32 "
                    "--output-dir ./gae/re10k_packed")


@pytest.fixture(scope="module")
def scannetpp_fastgen(term: Terminal) -> Ran:
    """README, Scenes: ScanNet++ with its depth as shards for FastGen's camera video loader."""
    for scene in ("a0", "a1"):
        render(term.cwd / "scannetpp", "scannetpp", scene=scene, frames=6)
    return term.run("diffprep raw --source-type scenes --scene-format scannetpp --input-dir ./scannetpp "
                    "--layout fastgen --scene-frames 5 --scene-resolution 32 --depth-resolution 16 "
                    "--output-dir ./scannetpp-fastgen --train-split 1")


@pytest.fixture(scope="module")
def wan_scenes(term: Terminal, tiny_wan: Path) -> Ran:
    """README, Scenes, pre-encoded with Wan: MVS-Synth's cameras beside the scenes' latents."""
    for scene in ("m0", "m1"):
        render(term.cwd / "mvs-synth", "mvssynth", scene=scene, frames=6)
    return term.run(f"diffprep encode --model-path {tiny_wan} --source-type scenes --scene-format mvssynth "
                    "--input-dir ./mvs-synth --scene-frames 5 --scene-resolution 32 --output-dir ./wan-scenes "
                    "--t5-max-length 16 --min-psnr 0 --train-split 1")


def _slides(cut: int, frames: int) -> bytes:
    """A hard cut from a blue slide to a green one (a small grey square moving over both), at 10 fps."""
    import torch

    from diffprep.media.mp4 import mp4_bytes

    out = torch.empty((frames, 3, 24, 32), dtype=torch.uint8)
    for i in range(frames):
        out[i] = torch.tensor((0, 0, 255) if i < cut else (0, 255, 0), dtype=torch.uint8)[:, None, None]
        out[i, :, :4, i % 28:i % 28 + 4] = 128
    return mp4_bytes(out, 10.0)


@pytest.fixture(scope="module")
def long_videos(term: Terminal) -> Ran:
    """README, Long videos: a talk in three shots, a game capture in two, slides in two, split at their cuts."""
    from test_long_videos import cut_clip

    films = term.cwd / "films"
    (films / "videos").mkdir(parents=True)
    (films / "captions").mkdir()
    (films / "videos" / "talk.mp4").write_bytes(cut_clip([30, 75], 100))
    (films / "videos" / "game.mp4").write_bytes(cut_clip([12], 40))
    (films / "videos" / "slides.mp4").write_bytes(_slides(30, 60))
    for name, caption in (("talk", "a talk in three shots"), ("game", "a game capture"), ("slides", "two slides")):
        (films / "captions" / f"{name}.txt").write_text(caption + "\n", encoding="utf-8")
    # The output on another disk, linked into the working folder (a link above the output, not inside it).
    (term.cwd.parent / "disk").mkdir()
    (term.cwd / "disk").symlink_to(term.cwd.parent / "disk", target_is_directory=True)
    return term.run("diffprep raw --source-type directory --input-dir ./films --output-dir ./disk/film-clips "
                    '--resolution-buckets "32x24x20;32x24x8" --target-fps 10 '
                    "--split-scenes adaptive --min-scene-seconds 0.5 --clip-mode chain --train-split 1")


# --- what each command printed and wrote -------------------------------------------------------------------------


def test_gae_layout_packs_each_scene(term, re10k_gae):
    recorded(written(re10k_gae).ok()).says("samples written: 2   rejected: 0", "validation: passed")
    for scene in ("s0", "s1"):
        folder = term.cwd / "gae" / "re10k_packed" / "train" / scene
        assert {"video.mp4", "meta.json", "caption.txt"} <= {p.name for p in folder.iterdir()}, scene
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["num_frames"] == 5 == len(meta["frames"]) and meta["fps"] == 15


def test_fastgen_camera_shards(term, scannetpp_fastgen):
    recorded(written(scannetpp_fastgen).ok()).says("samples written: 2   rejected: 0", "validation: passed")
    assert sum(json.loads((term.cwd / "scannetpp-fastgen" / "shard_counts.json").read_text()).values()) == 2


def test_wan_scenes(term, wan_scenes):
    recorded(written(wan_scenes).ok()).says("samples written: 2   rejected: 0", "validation: passed")


def test_long_videos_are_split_at_their_cuts(term, long_videos):
    """Shots 0-29, 30-74, 75-99 (talk), 0-11, 12-39 (game), 0-29, 30-59 (slides) at 10 fps: chained windows of 20
    frames, each shot's tail filled with the 8-frame bucket where it fits (talk 2 + 2 + 1 clips, game 1 + 2,
    slides 2 + 2; tails of 2, 5, 5, 4, 0, 2, 2 frames left). The README's detector (`adaptive`) finds the slides'
    blue-to-green cut, which `content` misses."""
    recorded(written(long_videos).ok()).says(
        "samples written: 12   rejected: 0", "long videos: 3 sources, 7 shots, 200 frames",
        "clips per bucket: 32x24x20 7, 32x24x8 5; frames in no clip: 20 chain_tail", "validation: passed")
    scenes = json.loads((term.cwd / "disk" / "film-clips" / ".diffprep" / "plan.json").read_text())["scenes"]
    assert scenes["slides.mp4"]["shots"] == [[0, 29], [30, 59]]


# --- every command over a written dataset, where it applies ------------------------------------------------------

OUTPUTS = {"re10k_gae": "./gae/re10k_packed", "scannetpp_fastgen": "./scannetpp-fastgen",
           "wan_scenes": "./wan-scenes", "long_videos": "./disk/film-clips"}
SHARDS = ["scannetpp_fastgen", "wan_scenes", "long_videos"]


def _dataset(request, name: str) -> str:
    written(request.getfixturevalue(name))
    return OUTPUTS[name]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_validate(term, request, name):
    validate(term, _dataset(request, name))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_decode(term, request, name):
    ran = decode(term, _dataset(request, name), f"./previews-{name}")
    if name != "long_videos":  # a posed scene's cameras drawn beside its frames
        assert len(list((term.cwd / f"previews-{name}").glob("*.cameras.png"))) == 2, ran.tail()


def test_latent_stats(term, wan_scenes):
    written(wan_scenes)
    latent_stats(term, OUTPUTS["wan_scenes"], "./stats-wan-scenes.pt")


@pytest.mark.parametrize("name", SHARDS)
def test_ignore_list(term, request, name):
    ignore_list(term, _dataset(request, name))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_finalize(term, request, name):
    finalize(term, _dataset(request, name))
