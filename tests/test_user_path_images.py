"""The user path, images: `diffprep` started as a new process in a fresh terminal (tests/user_shell.py), each
command as the README writes it, over small media these tests write; each dataset written once, then every
command over a written dataset that applies to it, each a new process too.

Datasets: the Quickstart (`diffprep tiny-model`, then `encode --config`), Flux in FastGen's layout, raw images,
captions only, ImageNet-64 as an EDM archive, ImageNet-256 latents through the sd-vae family, GAE's
text-to-image shards, and an MLPerf manifest through `diffprep ingest`. (CIFAR-10's archive is written as
ImageNet-64's is: tests/test_edm_zip.py reads its tarball; left out here for the layer's time.)

These assert what a user is promised, not what today's code happens to do: a failure here is a bug on the
user's path (or a README that says something else).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from class_folders import write_class_folders
from user_shell import (REPO, Ran, Terminal, decode, finalize, ignore_list, latent_stats, module_terminal, recorded,
                        validate, written)

pytestmark = [pytest.mark.user_path, pytest.mark.slow]

# Three ImageNet synsets (their ids name the folders, so the shipped names caption them).
SYNSETS = {"n01440764": 2, "n01443537": 2, "n01484850": 2}


@pytest.fixture(scope="module")
def term(tmp_path_factory) -> Iterator[Terminal]:
    yield from module_terminal(tmp_path_factory, "user-images", __name__)


@pytest.fixture(scope="module")
def inputs(term: Terminal) -> Path:
    """What the user has: demo images with captions, ImageNet-style class folders, the example config."""
    from diffprep.tools.demo import write_demo_dataset

    work = term.cwd
    write_demo_dataset(work / "demo" / "demo-data", samples=24)  # as `diffprep demo` writes it
    write_class_folders(work / "imagenet" / "train", SYNSETS)
    (work / "configs").mkdir()
    shutil.copy(REPO / "configs" / "example_directory.yaml", work / "configs")
    return work


# --- the datasets, each written once ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart(term: Terminal, inputs: Path) -> Ran:
    """README, Quickstart: the tiny Flux set, then the example config over the demo data (32 px to stay small)."""
    term.run("diffprep tiny-model ./tiny-flux").ok().says("tiny Flux encoder set written to")
    return term.run("diffprep encode --config configs/example_directory.yaml --model-path ./tiny-flux "
                    "--output-dir ./out --image-size 32")


@pytest.fixture(scope="module")
def flux_fastgen(term: Terminal, quickstart: Ran) -> Ran:
    """README, NVIDIA FastGen: `diffprep encode … --layout fastgen` (Flux images)."""
    return term.run("diffprep encode --source-type directory --input-dir ./demo/demo-data --model-path ./tiny-flux "
                    "--layout fastgen --output-dir ./flux-fastgen --image-size 32 --t5-max-length 16 --shard-size 4 "
                    "--min-psnr 0 --train-split 1")


@pytest.fixture(scope="module")
def raw_images(term: Terminal, inputs: Path) -> Ran:
    """README, Raw datasets: prepared images and captions, no encoders."""
    return term.run("diffprep raw --source-type directory --input-dir ./demo/demo-data --output-dir ./raw "
                    "--image-size 32 --image-format jpg --shard-size 4 --train-split 1")


@pytest.fixture(scope="module")
def prompts(term: Terminal, inputs: Path) -> Ran:
    """README, FastGen's PromptLoaderConfig: `diffprep raw --prompts-only --layout fastgen`."""
    return term.run("diffprep raw --prompts-only --layout fastgen --source-type directory "
                    "--input-dir ./demo/demo-data --output-dir ./prompts --shard-size 8 --train-split 1")


@pytest.fixture(scope="module")
def imagenet64(term: Terminal, inputs: Path) -> Ran:
    """README, EDM archives: ImageNet's train layout as FastGen's ImageNet64_Loader_Config reads it."""
    return term.run("diffprep raw --source-type imagefolder --input-dir imagenet/train --layout edm-zip "
                    "--image-size 64 --crop edm --image-format png --output-dir imagenet-64x64 --shard-size 4")


@pytest.fixture(scope="module")
def sd_vae(term: Terminal, inputs: Path) -> Ran:
    """README, ImageNet-256 latents: the sd-vae family's tiny VAE, its posterior per image in an EDM archive."""
    term.run("diffprep tiny-model ./sd-vae --family sd-vae").ok()
    return term.run("diffprep encode --model-path ./sd-vae --source-type imagefolder --input-dir imagenet/train "
                    "--layout edm-zip --image-size 64 --crop adm --output-dir imagenet-256 --shard-size 4")


@pytest.fixture(scope="module")
def ingest(term: Terminal) -> Ran:
    """README, Ingesting: one MLPerf manifest (two Arrow files of three rows) and its empty encodings."""
    from test_ingest import write_mlperf

    (term.cwd / "mlperf").mkdir()
    write_mlperf(term.cwd / "mlperf", files=2)
    return term.run("diffprep ingest --manifest ./mlperf/flux-1-tiny-preprocessed.uri "
                    "--empty-encodings ./mlperf/empty/flux-1-empty-encodings.uri --output-dir ./cc12m --train-split 1")


# --- what each command printed and wrote -------------------------------------------------------------------------


def test_quickstart_encode_prints_the_readmes_summary(term, quickstart):
    recorded(written(quickstart).ok()).says(
        f"dataset: {term.cwd / 'out'}", "samples written: 24   rejected: 0", "splits: train 3 shards / 24 samples",
        "validation: passed")
    out = term.cwd / "out"
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar", "000001.tar", "000002.tar"]
    assert (out / ".nv-meta" / "dataset.yaml").is_file()
    assert sorted(p.name for p in (out / "empty_encodings").iterdir()) == ["clip_empty.npy", "t5_empty.npy"]


def test_quickstart_commands_after_the_encode(term, quickstart):
    """The Quickstart's next three lines, as written: validate, finalize with a new split, the module's validate."""
    written(quickstart)
    term.run("diffprep validate ./out").ok().says("Validation passed")
    term.run("diffprep finalize ./out --train-split 0.8 --replace-split").ok().says("Validation passed")
    term.run("python -m diffprep.validation ./out --encoding preencoded").ok().says("Validation passed")


def test_flux_fastgen_writes_fastgens_members_and_files(term, flux_fastgen):
    recorded(written(flux_fastgen).ok()).says("samples written: 24   rejected: 0", "validation: passed")
    out = term.cwd / "flux-fastgen"
    counts = json.loads((out / "shard_counts.json").read_text())
    assert counts == {f"{u:06d}.tar": 4 for u in range(6)}
    assert (out / "neg_prompt_emb.npy").is_file() and (out / "neg_pooled_prompt_emb.npy").is_file()
    # What FastGen's WDSLoader hands on with the README's key map (and the ignore list that is still to come).
    from fastgen_loader import fastgen_samples

    samples = fastgen_samples(out, {"real": "latent.pth", "condition": "txt_emb.pth"})
    assert len(samples) == 24
    pooled, t5 = samples[0]["txt_emb.pth"]
    assert samples[0]["latent.pth"].shape == (16, 4, 4) and pooled.dim() == 1 and t5.shape[0] == 16


def test_raw_images_and_prompts_write_their_members(term, raw_images, prompts):
    recorded(written(raw_images).ok()).says("samples written: 24   rejected: 0", "validation: passed")
    recorded(written(prompts).ok()).says("samples written: 24   rejected: 0", "validation: passed")
    assert (term.cwd / "prompts" / "shard_counts.json").is_file()


def test_edm_archives_are_written(term, imagenet64, sd_vae):
    for ran, out in ((imagenet64, "imagenet-64x64"), (sd_vae, "imagenet-256")):
        recorded(written(ran).ok()).says("samples written: 6   rejected: 0", "validation: passed")
        with zipfile.ZipFile(term.cwd / out / "dataset.zip") as archive:
            labels = json.loads(archive.read("dataset.json"))["labels"]
            files = [name for name in archive.namelist() if name != "dataset.json"]
        # FastGen's ImageFolderDataset: one label per data file, the sorted class folders' indexes.
        assert len(files) == 6 and sorted(label for _, label in labels) == [0, 0, 1, 1, 2, 2], out


def test_ingest_writes_one_shard_per_file(term, ingest):
    written(ingest).ok().says("samples written: 6   rejected: 0", "validation: passed")
    out = term.cwd / "cc12m"
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar", "000001.tar"]
    assert sorted(p.name for p in (out / "empty_encodings").iterdir()) == ["clip_empty.npy", "t5_empty.npy"]


def test_t2i_imagenet_then_verify(term, inputs):
    """README, GAE's text-to-image data: the ImageNet shards, then what GAE's loader would find."""
    folder = "gae/Blip3o_style/ImageNet-1K-T2I"
    term.run(f"diffprep t2i imagenet --input-dir ./imagenet/train --output {folder} --shard-size 4").ok()
    shards = sorted(p.name for p in (term.cwd / folder).glob("*.tar"))
    assert shards == ["imagenet_00000.tar", "imagenet_00001.tar"]
    assert all((term.cwd / folder / f"{s}.done").is_file() for s in shards)
    term.run("diffprep verify-t2i gae/Blip3o_style --splits imagenet").ok()


def test_a_mistyped_setting_is_refused_by_name_before_anything_starts(term, inputs):
    """A key the config file does not know, a value out of range, a folder that is not there: one line each that
    names the setting and the fix, before any model or server starts."""
    (term.cwd / "mine.yaml").write_text("source:\n  type: directory\n  input_dir: ./demo/demo-data\n"
                                        "model:\n  batchsize: 4\n", encoding="utf-8")
    term.run("diffprep encode --config mine.yaml --output-dir ./never").refused(
        "unknown key 'batchsize' in section 'model'", "batch_size")
    term.run("diffprep raw --input-dir ./demo/demo-data --output-dir ./never --image-format gif").refused(
        "raw.image_format", "'jpg', 'png' or 'webp'")
    term.run("diffprep encode --input-dir ./demo/demo-dta --output-dir ./never").refused(
        "source.input_dir './demo/demo-dta' does not exist", "--input-dir")
    assert not (term.cwd / "never").exists()


# --- every command over a written dataset, where it applies ------------------------------------------------------

# dataset fixture -> its output folder as the user names it
OUTPUTS = {"quickstart": "./out", "flux_fastgen": "./flux-fastgen", "raw_images": "./raw", "prompts": "./prompts",
           "imagenet64": "./imagenet-64x64", "sd_vae": "./imagenet-256", "ingest": "./cc12m"}
PICTURES = ["quickstart", "flux_fastgen", "raw_images", "imagenet64"]
LATENTS = ["quickstart", "flux_fastgen", "sd_vae", "ingest"]
SHARDS = ["quickstart", "flux_fastgen", "raw_images", "prompts", "ingest"]  # the EDM archives are no shard layout
# The Quickstart's validate and finalize are in its own test.
VALIDATE = FINALIZE = ["flux_fastgen", "raw_images", "prompts", "imagenet64", "sd_vae", "ingest"]


def _dataset(request, name: str) -> str:
    written(request.getfixturevalue(name))
    return OUTPUTS[name]


@pytest.mark.parametrize("name", VALIDATE)
def test_validate(term, request, name):
    validate(term, _dataset(request, name))


@pytest.mark.parametrize("name", PICTURES)
def test_decode(term, request, name):
    decode(term, _dataset(request, name), f"./previews-{name}")


@pytest.mark.parametrize("name", LATENTS)
def test_latent_stats(term, request, name):
    latent_stats(term, _dataset(request, name), f"./stats-{name}.pt")


@pytest.mark.parametrize("name", SHARDS)
def test_ignore_list(term, request, name):
    ignore_list(term, _dataset(request, name))


@pytest.mark.parametrize("name", FINALIZE)
def test_finalize(term, request, name):
    finalize(term, _dataset(request, name))


def test_commands_that_do_not_apply_say_so_by_name(term, raw_images, sd_vae, imagenet64):
    """No traceback where a command has nothing to do: raw images hold no latents, diffprep decode does not read
    the sd-vae archive's posteriors, and an EDM archive is read by FastGen's ImageFolderDataset (no ignore list)."""
    written(raw_images), written(sd_vae), written(imagenet64)
    term.run("diffprep latent-stats ./raw").refused("no committed latents")
    term.run("diffprep decode ./imagenet-256 --samples 2 --to ./previews-sd-vae").refused("sd-vae posteriors")
    term.run("diffprep ignore-list ./imagenet-64x64").refused("not shards", "run `diffprep validate`")
