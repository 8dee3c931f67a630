"""The sd-vae family: the tiny set loads through from_pretrained, and the stored posterior is diffusers' own."""

from __future__ import annotations

import pytest
import torch

from diffprep.errors import ConfigError
from diffprep.families.sd_vae import is_sd_vae_folder, latent_shape, load_sd_vae
from diffprep.families.sd_vae_tiny import write_tiny_sd_vae


def test_posterior_is_diffusers_mean_and_std_from_pixels_in_minus_one_one(tmp_path) -> None:
    from diffusers import AutoencoderKL

    folder = write_tiny_sd_vae(tmp_path / "vae", seed=3)
    assert is_sd_vae_folder(folder) and sorted(p.name for p in folder.iterdir()) == [
        "config.json", "diffusion_pytorch_model.safetensors"]
    pixels = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    stored = load_sd_vae(str(folder)).posterior(pixels)
    assert stored.dtype == torch.float32 and list(stored.shape[1:]) == latent_shape(32) == [8, 4, 4]

    reference = AutoencoderKL.from_pretrained(folder).eval()
    with torch.no_grad():
        dist = reference.encode(pixels.float() / 127.5 - 1.0).latent_dist
    assert torch.equal(stored[:, :4], dist.mean) and torch.equal(stored[:, 4:], dist.std)  # exact in fp32
    assert (stored[:, 4:] > 0).all()


def test_the_tiny_set_is_written_by_the_cli_and_its_config_tells_the_family(tmp_path) -> None:
    from diffprep.cli import main
    from diffprep.families import family_of_model

    assert main(["tiny-model", str(tmp_path / "sd"), "--family", "sd-vae"]) == 0
    assert family_of_model(str(tmp_path / "sd")).name == "sd-vae"
    assert family_of_model(str(tmp_path)).name == "flux"  # a folder without the VAE config: as before


def write_classes(root):
    """Two class folders of two 48x40 noise PNGs each: the ImageNet train layout, small."""
    import numpy as np
    from PIL import Image

    for label, name in enumerate(["n0", "n1"]):
        (root / name).mkdir(parents=True)
        for i in range(2):
            pixels = np.random.default_rng(label * 2 + i).integers(0, 256, (40, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(root / name / f"{name}_{i}.png")
    return root


def sd_vae_settings(out, root, folder, shard_size: int = 4, **finalize):
    """An sd-vae edm-zip run's settings at 32 px (``finalize``: e.g. ``full_cov=True``)."""
    from diffprep.config import load_settings

    return load_settings(overrides={
        "source": {"type": "imagefolder", "input_dir": str(root)},
        "output": {"output_dir": str(out), "shard_size": shard_size, "layout": "edm-zip"},
        "model": {"model_path": str(folder), "device": "cpu"},
        "image": {"image_size": 32, "decode_workers": 1, "crop": "adm"},
        "finalize": {"train_split": 1.0, **finalize},
    })


def test_a_vae_with_other_latent_channels_is_refused(tmp_path) -> None:
    from diffprep.families.flux_tiny import _vae

    _vae().save_pretrained(tmp_path / "flux-vae")
    assert not is_sd_vae_folder(tmp_path / "flux-vae")
    with pytest.raises(ConfigError, match="16 latent channels"):
        load_sd_vae(str(tmp_path / "flux-vae"))


@pytest.mark.slow
def test_imagenet_256_latents_archive_holds_each_images_posterior(tmp_path) -> None:
    import json
    import zipfile

    import numpy as np

    from diffprep import contract
    from diffprep.phases.pipeline import run

    folder = write_tiny_sd_vae(tmp_path / "vae")
    root = write_classes(tmp_path / "train")
    out = tmp_path / "imagenet-256-sd"
    settings = sd_vae_settings(out, root, folder)
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).samples == 4
    vae = load_sd_vae(str(folder))
    from diffprep.media.images import ImageSpec, prepare_image

    spec = ImageSpec(image_size=32, crop="adm")
    with zipfile.ZipFile(out / contract.EDM_ZIP) as zf:
        names = zf.namelist()
        assert names == [f"00000/img-mean-std-{i:08d}.npy" for i in range(4)] + ["dataset.json"]
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        labels = dict(json.loads(zf.read("dataset.json"))["labels"])
        sources = [root / "n0" / "n0_0.png", root / "n0" / "n0_1.png", root / "n1" / "n1_0.png",
                   root / "n1" / "n1_1.png"]
        # One unit, one batch of four (CPU kernels change last bits with the batch shape, not with anything else).
        want = vae.posterior(torch.stack([prepare_image(p.read_bytes(), spec).pixels for p in sources])).numpy()
        for index, name in enumerate(names[:-1]):
            with zf.open(name) as handle:
                stored = np.load(handle)  # FastGen reads it so; reshape(-1, H, W) keeps [8, 4, 4]
            assert stored.dtype == np.float32 and stored.shape == (8, 4, 4)
            assert np.array_equal(stored, want[index]) and labels[name] == index // 2
    report = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())
    assert report["ok"], report

    # Resumed with the unit's manifest gone: verify-existing reads the shard, the unit is redone, the same archive.
    archive = (out / contract.EDM_ZIP).read_bytes()
    (out / contract.unit_manifest_path(0)).unlink()
    settings.output.on_existing = "resume"
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).samples == 4
    assert (out / contract.EDM_ZIP).read_bytes() == archive


def test_sd_vae_edm_zip_through_the_cli_and_the_prefect_flow_matches_the_library(prefect_server, tmp_path):
    """`diffprep encode --layout edm-zip` with the sd-vae family, in its own process through the encode flow (the
    CLI's flags, the Prefect tasks, finalize's archive): the archive pipeline.run writes, byte for byte."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    from diffprep import contract
    from diffprep.phases.pipeline import run

    repo = Path(__file__).resolve().parents[1]
    folder = write_tiny_sd_vae(tmp_path / "vae")
    root = write_classes(tmp_path / "train")
    cli_out, lib_out = tmp_path / "cli", tmp_path / "lib"
    cli = subprocess.run(
        [sys.executable, "-m", "diffprep", "encode", "--source-type", "imagefolder", "--input-dir", str(root),
         "--output-dir", str(cli_out), "--shard-size", "4", "--layout", "edm-zip", "--image-size", "32", "--crop",
         "adm", "--decode-workers", "1", "--train-split", "1.0", "--model-path", str(folder), "--device", "cpu"],
        env=os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(repo)},
        capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert "validation: passed" in cli.stdout
    settings = sd_vae_settings(lib_out, root, folder)
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).samples == 4
    assert (cli_out / contract.EDM_ZIP).read_bytes() == (lib_out / contract.EDM_ZIP).read_bytes()


def archive_mean_halves(path):
    """Every ``img-mean-std-*.npy`` of the archive, read with numpy as FastGen reads it: its first half of the
    channels (the posterior mean), float64, in name order."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path) as zf:
        names = sorted(n for n in zf.namelist() if n.endswith(".npy"))
        arrays = []
        for name in names:
            with zf.open(name) as handle:
                array = np.load(handle, allow_pickle=False)
            arrays.append(array[: array.shape[0] // 2].astype(np.float64))
    return arrays


@pytest.mark.slow
def test_the_archives_latent_stats_are_of_its_posterior_means(tmp_path, capsys) -> None:
    """An sd-vae edm-zip run over two units with --full-cov: latent_stats.pt (the units' merged moments) is the
    mean, std and covariance of the archive's posterior means, marked ``of: mean``, checked by validation against
    the archive, and `diffprep latent-stats` reproduces it from the committed shards; a unit's moments that do not
    match fail validation."""
    import json

    import numpy as np

    from diffprep import contract
    from diffprep.cli import main
    from diffprep.report.latent_stats import unit_stats_path
    from diffprep.phases.pipeline import run
    from diffprep.validation import validate_dataset
    from latent_direct import close32

    folder = write_tiny_sd_vae(tmp_path / "vae")
    out = tmp_path / "imagenet-256-sd"
    settings = sd_vae_settings(out, write_classes(tmp_path / "train"), folder, shard_size=2, full_cov=True)
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    assert result.samples == 4 and result.validation["ok"], result.validation
    state = out / contract.STATE_DIR
    assert sorted(p.name for p in (state / contract.UNIT_STATS_DIR).iterdir()) == ["000000.pt", "000001.pt"]
    saved = torch.load(state / contract.LATENT_STATS, weights_only=True)

    means = archive_mean_halves(out / contract.EDM_ZIP)
    assert len(means) == 4 and means[0].shape == (4, 4, 4)
    values = np.concatenate([m.reshape(4, -1) for m in means], axis=1)
    mean, std, cov = values.mean(axis=1), values.std(axis=1), np.cov(values, bias=True)
    assert saved["of"] == "mean" and int(saved["samples"]) == 4 and int(saved["count"]) == 4 * 4 * 4
    for name, want in (("mean", mean), ("std", std), ("cov", cov)):
        assert saved[name].dtype == torch.float32 and list(saved[name].shape) == list(want.shape), name
        assert close32(saved[name], torch.from_numpy(want)), name
    assert {"whiten", "unwhiten", "condition"} <= set(saved)
    report = json.loads((state / contract.VALIDATION_JSON).read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["latent stats of the archive"]["ok"] and checks["latent stats from the units"]["ok"]
    assert report["summary"]["latent_stats"]["of"] == "mean"
    assert report["summary"]["latent_stats_full"] | {"condition": None} == {
        "count": 64, "samples": 4, "channels": 4, "of": "mean", "condition": None}

    # The command, from the committed unit shards: the file's numbers (to float32 precision).
    capsys.readouterr()
    path = tmp_path / "stats.pt"
    assert main(["latent-stats", str(out), "--full-cov", "--output", str(path)]) == 0
    assert "latent statistics of the mean of 4 samples (64 values per channel, 4 channels" in capsys.readouterr().out
    computed = torch.load(path, weights_only=True)
    assert sorted(computed) == sorted(saved) and computed["of"] == "mean"
    for name in ("mean", "std", "cov", "whiten", "unwhiten"):
        assert close32(computed[name], saved[name]), name
    assert int(computed["count"]) == int(saved["count"]) and int(computed["samples"]) == int(saved["samples"])
    # Over that file, only when asked (--no-full-cov): per channel only.
    assert main(["latent-stats", str(out), "--no-full-cov", "--output", str(path)]) == 0
    assert sorted(torch.load(path, weights_only=True)) == ["count", "mean", "of", "samples", "std"]

    # A unit's moments that are not its shard's: validation fails on the archive's check, naming the fix.
    unit = torch.load(state / unit_stats_path(1), weights_only=True)
    unit["fields"][contract.SD_VAE_POSTERIOR]["mean"] += 1.0
    torch.save(unit, state / unit_stats_path(1))
    report = validate_dataset(out)
    failed = [check for check in report.checks if not check.ok]
    assert not report.ok and [check.name for check in failed] == ["latent stats of the archive"]
    assert "diffprep latent-stats OUT" in failed[0].detail
