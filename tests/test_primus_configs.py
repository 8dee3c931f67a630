"""Primus's own preprocessing configs run with diffprep unchanged.

Every file of AMD-AGI/Primus ``primus/configs/data/megatron/diffusion/preprocessing/`` (at fd1eeab) has a fixture
in ``tests/primus_configs/`` with the same keys, nesting, spellings and values. Each encode config runs through the
whole pipeline (plan, sanity, units, audit, finalize, validation) with only its output folder, its source location
(small local data the test writes in the shape of the config's dataset) and the model path (the tiny model)
overridden -- plus what the tiny model and a machine without a GPU need: ``min_psnr 0`` (random weights cannot
reconstruct an image); without CUDA, ``device cpu`` where the config says ``device: cuda`` (the config as written
is then refused with the fix, checked below) and 32 px images (bf16 convolutions on a CPU take seconds a batch at
256 px; every other setting, bf16 included, stays as the config has it). Primus's ingest config is refused with
the command that runs it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from PIL import Image

from diffprep import contract
from diffprep.config import check_runnable, load_settings
from diffprep.errors import ConfigError
from diffprep.pipeline import run

FIXTURES = Path(__file__).resolve().parent / "primus_configs"


def _image(i: int, fmt: str = "PNG") -> bytes:
    picture = Image.new("RGB", (40 + 8 * i, 30), (40 * i % 256, 120, 200))
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    return buffer.getvalue()


CAPTIONS = ["a small blue square", "a wide green field"]


def _hf_folder(root: Path, caption_feature: Any, captions: list[Any]) -> Path:
    """A save_to_disk dataset with a train split: an ``image`` column and a ``caption``/``text`` column."""
    import datasets

    name, feature = caption_feature
    rows = {"image": [{"bytes": _image(i), "path": None} for i in range(len(captions))], name: captions}
    features = datasets.Features({"image": datasets.Image(), name: feature})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(root))
    return root


def pokemon(root: Path) -> Path:
    """diffusers/pokemon-gpt4-captions: ``image`` and ``text``."""
    import datasets

    return _hf_folder(root, ("text", datasets.Value("string")), CAPTIONS)


def coco_2014(root: Path) -> Path:
    """AbdoTW/COCO_2014: ``image`` and ``caption``, a list of captions (the first is taken)."""
    import datasets

    return _hf_folder(root, ("caption", datasets.Sequence(datasets.Value("string"))),
                      [[caption, "another caption"] for caption in CAPTIONS])


def recap_coco(root: Path) -> Path:
    """UCSC-VLAA/Recap-COCO-30K: ``image`` and ``caption``, a string."""
    import datasets

    return _hf_folder(root, ("caption", datasets.Value("string")), CAPTIONS)


def _tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def text_to_image_2m(root: Path) -> Path:
    """jackyhate/text-to-image-2M: webdataset tars under data_1024_10K/, ``jpg`` + ``json`` holding ``prompt``."""
    members = {}
    for i, caption in enumerate(CAPTIONS):
        members[f"{i:05d}.jpg"] = _image(i, "JPEG")
        members[f"{i:05d}.json"] = json.dumps({"prompt": caption, "width": 40 + 8 * i}).encode()
    _tar(root / "data_1024_10K" / "00000.tar", members)
    return root


def image_folder(root: Path) -> Path:
    """A directory source: images/ and captions/ paired by stem (Primus's load_from_directory layout)."""
    (root / "images").mkdir(parents=True)
    (root / "captions").mkdir()
    for i, caption in enumerate(CAPTIONS):
        (root / "images" / f"{i:05d}.png").write_bytes(_image(i))
        (root / "captions" / f"{i:05d}.txt").write_text(caption, encoding="utf-8")
    return root


def shards(root: Path) -> str:
    """Existing webdataset shards of ``jpg`` + ``txt``; returns the glob, as ``source.input_path`` takes it."""
    members = {}
    for i, caption in enumerate(CAPTIONS):
        members[f"sample_{i:06d}.jpg"] = _image(i, "JPEG")
        members[f"sample_{i:06d}.txt"] = caption.encode()
    _tar(root / "000000.tar", members)
    return str(root / "*.tar")


# Every config in Primus's folder: the source location setting the test overrides and the data it writes there.
ENCODE_CONFIGS: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "coco2014_train_schnell_256.yaml": ("hf_dataset", coco_2014),
    "coco_schnell_256.yaml": ("hf_dataset", recap_coco),
    "example_base.yaml": ("hf_dataset", pokemon),
    "example_directory.yaml": ("input_dir", image_folder),
    "example_huggingface.yaml": ("hf_dataset", pokemon),
    "example_webdataset.yaml": ("input_path", shards),
    "quickstart_pokemon.yaml": ("hf_dataset", pokemon),
    "text_to_image_2m_10k.yaml": ("hf_dataset", text_to_image_2m),
}
INGEST_CONFIGS = ["mlperf_flux1.yaml"]
NO_CUDA = not torch.cuda.is_available()


def test_there_is_a_fixture_for_every_primus_config_and_no_other() -> None:
    assert sorted(path.name for path in FIXTURES.glob("*.yaml")) == sorted([*ENCODE_CONFIGS, *INGEST_CONFIGS])


def _read_samples(out: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, field = member.name.partition(".")
                samples.setdefault(key, {})[field] = tar.extractfile(member).read()
    return samples


def _overrides(config: Path, location: str, source: Any, out: Path, tiny_model: Path) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {"output": {"output_dir": str(out)}, "source": {location: str(source)},
                                            "model": {"model_path": str(tiny_model), "min_psnr": 0.0}}
    if NO_CUDA:
        overrides["image"] = {"image_size": 32}
        if load_settings(config).model.device.startswith("cuda"):
            overrides["model"]["device"] = "cpu"
    return overrides


@pytest.mark.parametrize("name", sorted(ENCODE_CONFIGS))
def test_primus_encode_config_runs(name: str, tiny_model: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRIMUS_DATA_ROOT", raising=False)
    config = FIXTURES / name
    location, write = ENCODE_CONFIGS[name]
    source = write(tmp_path / "source")
    out = tmp_path / "out"
    settings = load_settings(config, _overrides(config, location, source, out, tiny_model))
    check_runnable(settings)

    result = run(settings, "preencoded")

    assert result.action == "fresh"
    assert (result.samples, result.rejected) == (len(CAPTIONS), 0)
    assert result.validation["ok"]
    samples = _read_samples(out)
    assert sorted(s["caption.txt"].decode() for s in samples.values()) == sorted(CAPTIONS)
    size = settings.image.image_size
    for sample in samples.values():
        latents = torch.load(io.BytesIO(sample["latents.pth"]), weights_only=True)
        assert list(latents.shape) == [16, size // 8, size // 8]
        assert latents.dtype == torch.bfloat16  # precision: bf16 in every Primus config
        # center_crop: false in every Primus config: the whole (non-square) image is stretched to the square.
        meta = json.loads(sample["meta.json"])
        assert meta["crop_box"] == [0, 0, *meta["original_size"]]
        # The one with vae_latent_mode: resample stores the raw posterior too.
        assert ({"mean.pth", "logvar.pth"} <= set(sample)) == (name == "coco_schnell_256.yaml")
    assert not [path for path in tmp_path.rglob("*") if "${" in path.name]


@pytest.mark.slow
def test_primus_output_dir_expands_its_variable(tiny_model: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI, without --output-dir: ``${PRIMUS_DATA_ROOT:...}/quickstart_pokemon`` is the folder written."""
    source = pokemon(tmp_path / "source")
    env = {**os.environ, "PRIMUS_DATA_ROOT": str(tmp_path / "data"), "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [sys.executable, "-m", "diffprep", "encode", "--config", str(FIXTURES / "quickstart_pokemon.yaml"),
               "--hf-dataset", str(source), "--model-path", str(tiny_model), "--min-psnr", "0",
               *(["--image-size", "32"] if NO_CUDA else [])]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "data" / "quickstart_pokemon"
    assert f"dataset: {out}" in done.stdout
    assert (out / contract.NV_META / contract.DATASET_YAML).is_file()
    assert not [path for path in tmp_path.rglob("*") if "${" in path.name]


@pytest.mark.skipif(not NO_CUDA, reason="with a GPU the config runs as written")
def test_a_primus_config_for_cuda_is_refused_on_a_machine_without_one(tiny_model: Path, tmp_path: Path) -> None:
    config = FIXTURES / "example_directory.yaml"
    overrides = _overrides(config, "input_dir", image_folder(tmp_path / "source"), tmp_path / "out", tiny_model)
    del overrides["model"]["device"]
    with pytest.raises(ConfigError) as caught:
        run(load_settings(config, overrides), "preencoded")
    assert str(caught.value) == "model.device is 'cuda' but CUDA is not available here; use cpu or auto"


@pytest.mark.parametrize("name", INGEST_CONFIGS)
def test_primus_ingest_config_is_refused_with_the_command_that_runs_it(name: str) -> None:
    config = FIXTURES / name
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert str(caught.value) == (
        f"{config} is a Primus `data diffusion-ingest` config (sections datasets, empty_encodings, pipeline): it "
        f"converts datasets that are already encoded, it does not encode. Run it with `diffprep ingest --config "
        f"{config}`"
    )
