"""The user path, clips: `diffprep` started as a new process in a fresh terminal (tests/user_shell.py), each
command as the README writes it, over small clips these tests write; each dataset written once, then every
command over a written dataset that applies to it, each a new process too.

Datasets: Wan clips in the Energon and FastGen layouts, raw clips with their sound (FastGen's
VideoAudioLoaderConfig), LTX-2 clips with audio in the Energon layout and in the LTX trainer's `.precomputed/`.
The tiny Wan and LTX-2 sets are the session's (tests/conftest.py), written by the code `diffprep tiny-model` runs.

These assert what a user is promised, not what today's code happens to do: a failure here is a bug on the
user's path (or a README that says something else).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from user_shell import (Ran, Terminal, decode, finalize, ignore_list, latent_stats, module_terminal, recorded, validate,
                        written)

pytestmark = [pytest.mark.user_path, pytest.mark.slow]

WAN_BUCKETS = "32x24x5;24x32x5;24x24x5"
LTX_BUCKET = "64x64x9"  # LTX-2: sides multiples of 32, F = 8k + 1


@pytest.fixture(scope="module")
def term(tmp_path_factory) -> Iterator[Terminal]:
    yield from module_terminal(tmp_path_factory, "user-clips", __name__)


@pytest.fixture(scope="module")
def clips(term: Terminal) -> Path:
    """A folder of four moving-shape clips with captions (videos/ + captions/), 48-64 px, 9-13 frames."""
    from diffprep.tools.demo import write_demo_clips

    return write_demo_clips(term.cwd / "clips", samples=4)


@pytest.fixture(scope="module")
def av_clips(term: Terminal) -> Path:
    """The LTX trainer's dataset file beside three 64 px clips with AAC sound (stereo, mono, 5.1)."""
    from diffprep.tools.demo import write_av_clip

    root = term.cwd / "dataset"
    rows = []
    for index, layout in enumerate(["stereo", "mono", "5.1"]):
        relative = f"clips/{index}.mp4"
        (root / "clips").mkdir(parents=True, exist_ok=True)
        write_av_clip(root / relative, fps=24, seed=index, audio_layout=layout)
        rows.append({"caption": f"a cat walking in the city {index}", "video": relative})
    (root / "dataset.json").write_text(json.dumps(rows), encoding="utf-8")
    return root


# --- the datasets, each written once ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan(term: Terminal, clips: Path, tiny_wan: Path) -> Ran:
    """README, Video: Wan clips from a folder, one bucket per shard (`encoding: wan`)."""
    return term.run(f"diffprep encode --model-path {tiny_wan} --source-type directory --input-dir ./clips "
                    f"--resolution-buckets {WAN_BUCKETS} --target-fps 8 --output-dir ./wan-out "
                    "--t5-max-length 16 --min-psnr 0 --train-split 1")


@pytest.fixture(scope="module")
def wan_fastgen(term: Terminal, clips: Path, tiny_wan: Path) -> Ran:
    """README, NVIDIA FastGen: `diffprep encode … --layout fastgen` (Wan clips, VideoLatentLoaderConfig)."""
    return term.run(f"diffprep encode --model-path {tiny_wan} --source-type directory --input-dir ./clips "
                    f"--resolution-buckets {WAN_BUCKETS} --target-fps 8 --layout fastgen --output-dir ./wan-fastgen "
                    "--t5-max-length 16 --min-psnr 0 --train-split 1")


@pytest.fixture(scope="module")
def raw_clips(term: Terminal, av_clips: Path) -> Ran:
    """README, FastGen's VideoAudioLoaderConfig: `diffprep raw --resolution-buckets … --keep-audio`."""
    return term.run("diffprep raw --source-type metadata --metadata-file ./dataset/dataset.json "
                    "--resolution-buckets 32x32x9 --keep-audio --output-dir ./raw-clips --train-split 1")


@pytest.fixture(scope="module")
def ltx2(term: Terminal, av_clips: Path, tiny_ltx2: Path) -> Ran:
    """README, LTX-2: clips with their sound through the tiny LTX-2 set, the Energon layout (`encoding: ltx2`)."""
    return term.run(f"diffprep encode --source-type metadata --metadata-file ./dataset/dataset.json "
                    f"--model-path {tiny_ltx2} --resolution-buckets {LTX_BUCKET} --output-dir ./ltx2-out "
                    "--min-psnr 0 --train-split 1")


@pytest.fixture(scope="module")
def ltx_layout(term: Terminal, av_clips: Path, tiny_ltx2: Path) -> Ran:
    """README, LTX-2: its command as written, the trainer's own folders in the dataset's folder, Gemma in int8."""
    return term.run(f"diffprep encode --source-type metadata --metadata-file ./dataset/dataset.json "
                    f"--model-path {tiny_ltx2} --resolution-buckets {LTX_BUCKET} --layout ltx --output-dir ./dataset "
                    "--load-text-encoder-in-8bit --min-psnr 0")


# --- what each command printed and wrote -------------------------------------------------------------------------


def test_wan_clips_in_both_layouts(term, wan, wan_fastgen):
    for ran in (wan, wan_fastgen):
        recorded(written(ran).ok()).says("samples written: 4   rejected: 0", "validation: passed")
    from fastgen_loader import fastgen_samples

    samples = fastgen_samples(term.cwd / "wan-fastgen", {"real": "latent.pth", "condition": "txt_emb.pth"})
    assert len(samples) == 4 and all(s["latent.pth"].shape[:2] == (16, 2) for s in samples)
    assert (term.cwd / "wan-fastgen" / "neg_prompt_emb.npy").is_file()
    assert sum(json.loads((term.cwd / "wan-fastgen" / "shard_counts.json").read_text()).values()) == 4


def test_raw_clips_keep_their_sound(term, raw_clips):
    recorded(written(raw_clips).ok()).says("samples written: 3   rejected: 0", "validation: passed")


def test_ltx2_clips_with_audio(term, ltx2):
    recorded(written(ltx2).ok()).says("samples written: 3   rejected: 0", "validation: passed")


def test_ltx_layout_writes_the_trainers_folders(term, ltx_layout):
    recorded(written(ltx_layout).ok()).says("samples written: 3   rejected: 0", "validation: passed",
                                            "    latents/: 3 files", "    audio_latents/: 3 files")
    # What the trainer's PrecomputedDataset reads, each record as the trainer's mode table names it.
    from test_ltx2_pipeline import assert_a1, trainer_samples

    samples = trainer_samples(term.cwd / "dataset" / ".precomputed", ("latents", "conditions", "audio_latents"))
    assert sorted(samples) == ["clips/0.pt", "clips/1.pt", "clips/2.pt"]
    for sample in samples.values():
        assert_a1(sample, frames=9, size=64, fps=24.0, seconds=9 / 24)


# --- every command over a written dataset, where it applies ------------------------------------------------------

OUTPUTS = {"wan": "./wan-out", "wan_fastgen": "./wan-fastgen", "raw_clips": "./raw-clips", "ltx2": "./ltx2-out",
           "ltx_layout": "./dataset"}
LATENTS = ["wan", "wan_fastgen", "ltx2", "ltx_layout"]
SHARDS = ["wan", "wan_fastgen", "raw_clips", "ltx2"]


def _dataset(request, name: str) -> str:
    written(request.getfixturevalue(name))
    return OUTPUTS[name]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_validate(term, request, name):
    validate(term, _dataset(request, name))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_decode(term, request, name):
    ran = decode(term, _dataset(request, name), f"./previews-{name}")
    assert len(list((term.cwd / f"previews-{name}").glob("*.mp4"))) == 2, ran.tail()


@pytest.mark.parametrize("name", LATENTS)
def test_latent_stats(term, request, name):
    stats = latent_stats(term, _dataset(request, name), f"./stats-{name}.pt")
    if name.startswith("ltx"):
        assert "audio_latents" in stats  # the audio latents' statistics under their field's name


@pytest.mark.parametrize("name", SHARDS)
def test_ignore_list(term, request, name):
    ignore_list(term, _dataset(request, name))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_finalize(term, request, name):
    finalize(term, _dataset(request, name))


def test_an_ignore_list_of_the_ltx_layout_is_refused_by_name(term, ltx_layout):
    """The LTX trainer reads files, not shards: there is nothing for an ignore list to name. Named by its
    --output-dir, as validate, decode, finalize and latent-stats take it (README, Commands)."""
    written(ltx_layout)
    term.run("diffprep ignore-list ./dataset").refused("not shards", "run `diffprep validate`")
