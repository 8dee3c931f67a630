"""Primus's own preprocessing configs run with diffprep unchanged.

Every file of AMD-AGI/Primus ``primus/configs/data/megatron/diffusion/preprocessing/`` (at fd1eeab) has a fixture
in ``tests/primus_configs/`` with the same keys, nesting, spellings and values. Each encode config runs through the
whole pipeline (plan, sanity, units, audit, finalize, validation) with only its output folder, its source location
(small local data the test writes in the shape of the config's dataset) and the model path (the tiny model)
overridden -- plus what the tiny model and a machine without a GPU need: ``min_psnr 0`` (random weights cannot
reconstruct an image); without CUDA, ``device cpu`` where the config says ``device: cuda`` (the config as written
is then refused with the fix, checked below) and 32 px images (bf16 convolutions on a CPU take seconds a batch at
256 px; every other setting, bf16 included, stays as the config has it). Primus's ingest config runs through
`diffprep ingest --config` with only ``PRIMUS_DATA_ROOT`` (or ``--output-dir``) set and its manifest URLs pointed at
local stand-ins the test serves over HTTP; `diffprep encode` refuses it with the command that runs it.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow.ipc
import pytest
import torch
import yaml
from PIL import Image

from diffprep import contract
from diffprep.cli import main
from diffprep.config import check_runnable, load_settings
from diffprep.run.energon import read_split_yaml
from diffprep.errors import ConfigError
from diffprep.phases.pipeline import run
from test_ingest import write_arrow, write_manifest

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


MLCOMMONS = "https://training.mlcommons-storage.org"
# MLCommons' datasets as the config names them, and the stand-ins served here: Arrow files of n rows each.
MLPERF_DATASETS = {"cc12m": ("flux-1-cc12m-preprocessed", [3, 2]), "coco": ("flux-1-coco-preprocessed", [2])}


@pytest.fixture
def mlcommons(tmp_path: Path):
    """A local MLCommons: ``metadata/<manifest>.uri`` / ``.md5`` naming Arrow files (``__key__`` in cc12m's, not in
    COCO's) and the empty encodings, served over HTTP; yields the server's URL and the folder."""
    root = tmp_path / "mlcommons"
    metadata = root / "metadata"
    metadata.mkdir(parents=True)
    handler = functools.partial(_QuietFiles, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    for seed, (dataset, (manifest, rows)) in enumerate(MLPERF_DATASETS.items()):
        folder = root / dataset
        folder.mkdir()
        names = [f"{dataset}-{i:04d}.arrow" for i in range(len(rows))]
        for i, (name, count) in enumerate(zip(names, rows)):
            write_arrow(folder / name, count, seed * 10 + i, keys=dataset == "cc12m")
        write_manifest(folder, manifest, dict.fromkeys(names), base=f"{url}/{dataset}")
        for suffix in (".uri", ".md5"):
            (folder / f"{manifest}{suffix}").rename(metadata / f"{manifest}{suffix}")
    empty = root / "empty"
    empty.mkdir()
    for name, shape in ((contract.T5_EMPTY, (1, 6, 8)), (contract.CLIP_EMPTY, (1, 8))):
        np.save(empty / name, np.zeros(shape, np.float32), allow_pickle=False)
    write_manifest(empty, "flux-1-empty-encodings", dict.fromkeys([contract.T5_EMPTY, contract.CLIP_EMPTY]),
                   base=f"{url}/empty")
    for suffix in (".uri", ".md5"):
        (empty / f"flux-1-empty-encodings{suffix}").rename(metadata / f"flux-1-empty-encodings{suffix}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield url, root
    httpd.shutdown()
    httpd.server_close()
    thread.join()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _pointed_at(config: Path, url: str, folder: Path) -> Path:
    """The config as it is, its manifest URLs on ``url`` instead of MLCommons' storage."""
    text = config.read_text()
    assert text.count(MLCOMMONS) == 3
    copy = folder / config.name
    copy.write_text(text.replace(MLCOMMONS, url))
    return copy


def _tree(out: Path) -> dict[str, str]:
    """The dataset's files but Energon's index (a new uuid each prepare) and diffprep's state."""
    index = {contract.INDEX_SQLITE, "index.uuid"}
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and contract.STATE_DIR not in p.parts and p.name not in index}


def test_primus_ingest_config_runs(mlcommons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Primus's `data diffusion-ingest` makes of mlperf_flux1.yaml: one Energon dataset at
    ``${PRIMUS_DATA_ROOT}/mlperf_flux1`` (encoding preencoded_numpy) whose train split is CC12M's files and val split
    COCO's, each file one shard, and the empty encodings in ``empty_encodings/``."""
    url, root = mlcommons
    config = _pointed_at(FIXTURES / "mlperf_flux1.yaml", url, tmp_path)
    monkeypatch.setenv("PRIMUS_DATA_ROOT", str(tmp_path / "data"))
    assert main(["ingest", "--config", str(config)]) == 0
    out = tmp_path / "data" / "mlperf_flux1"

    # One unit per file across the datasets, in the config's order: cc12m's two, then coco's one.
    from diffprep.writer.plan import read_plan

    assert [u.source_ids for u in read_plan(out).units] == [["cc12m/cc12m-0000.arrow"], ["cc12m/cc12m-0001.arrow"],
                                                            ["coco/coco-0000.arrow"]]
    assert read_split_yaml(out) == {"000000.tar": "train", "000001.tar": "train", "000002.tar": "val"}
    info = json.loads((out / contract.NV_META / contract.INFO_JSON).read_text())
    assert info["shard_counts"] == {"000000.tar": 3, "000001.tar": 2, "000002.tar": 2}
    assert "encoding: preencoded_numpy" in (out / contract.NV_META / contract.DATASET_YAML).read_text()
    validation = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert validation["ok"], validation
    assert {s: v["samples"] for s, v in validation["summary"]["splits"].items()} == {"train": 5, "val": 2}
    for name in (contract.T5_EMPTY, contract.CLIP_EMPTY):
        assert (out / contract.EMPTY_ENCODINGS_DIR / name).read_bytes() == (root / "empty" / name).read_bytes()

    # Every row stored as it came, under Primus's member names; json.key is the row's __key__ where it has one.
    for shard, (dataset, file) in {"000000.tar": ("cc12m", "cc12m-0000"), "000002.tar": ("coco", "coco-0000")}.items():
        table = pyarrow.ipc.open_stream(str(root / dataset / f"{file}.arrow")).read_all()
        with tarfile.open(out / shard) as tar:
            for row in range(table.num_rows):
                key = f"{shard[:6]}_{row:06d}"
                for column, field in zip(contract.MLPERF_COLUMNS, contract.INGESTED_FIELDS):
                    assert tar.extractfile(f"{key}.{field}").read() == table.column(column)[row].as_py()
                meta = json.loads(tar.extractfile(f"{key}.{contract.INGESTED_META}").read())
                assert meta == {"key": f"{file}-{row:04d}" if dataset == "cc12m" else key,
                                "source_id": f"{dataset}/{file}.arrow#{row}"}
    assert not (out / contract.STATE_DIR / contract.DOWNLOADS_DIR).exists()

    # Run again: complete, nothing changes.
    before = _tree(out)
    shards = [f"00000{i}.tar{suffix}" for i in range(3) for suffix in ("", ".idx")]
    assert sorted(before) == sorted([*shards, *(f"{contract.NV_META}/{n}" for n in (
        contract.INFO_JSON, contract.DATASET_YAML, contract.SPLIT_YAML)),
        *(f"{contract.EMPTY_ENCODINGS_DIR}/{n}" for n in (contract.T5_EMPTY, contract.CLIP_EMPTY))])
    assert main(["ingest", "--config", str(config)]) == 0
    assert _tree(out) == before

    # --output-dir instead of PRIMUS_DATA_ROOT, and pipeline.max_files as Primus counts it: per dataset.
    monkeypatch.delenv("PRIMUS_DATA_ROOT")
    data = yaml.safe_load(config.read_text())
    data["pipeline"]["max_files"] = 1
    one = tmp_path / "one_file.yaml"
    one.write_text(yaml.safe_dump(data))
    assert main(["ingest", "--config", str(one), "--output-dir", str(tmp_path / "first")]) == 0
    assert read_split_yaml(tmp_path / "first") == {"000000.tar": "train", "000001.tar": "val"}
    assert not [path for path in tmp_path.rglob("*") if "${" in path.name]


@pytest.mark.parametrize("name", INGEST_CONFIGS)
def test_primus_ingest_config_is_refused_by_encode_with_the_command_that_runs_it(name: str) -> None:
    config = FIXTURES / name
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert str(caught.value) == (
        f"{config} is a Primus `data diffusion-ingest` config (sections datasets, empty_encodings, pipeline): it "
        f"converts datasets that are already encoded, it does not encode. Run it with `diffprep ingest --config "
        f"{config}`"
    )
