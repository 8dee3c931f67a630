"""Decode and verify: latents back to images through the dataset's VAE, PSNR, contact sheets, the sanity
threshold and the validate summary, on a real dataset encoded with the tiny model.

The tiny model's VAE has random weights: its round trip is about 8 dB, so these tests check that the
numbers are computed, consistent and reported, and that a threshold set above them fails the sanity check.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# Prefect's console log handler keeps the stream it finds when prefect is first imported: import it
# here, at collection, so it holds pytest's session stream rather than one test's capture buffer.
import diffprep.flows.encode  # noqa: F401

from conftest import SMALL_SETTINGS
from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.cli import main
from diffprep.config import Settings, SourceConfig, load_settings
from diffprep.validation.decode import decode_dataset, read_samples, source_config
from diffprep.families.flux_vae import VaeDecoder
from diffprep.report.pictures import CONTACT_SHEET
from diffprep.tools.demo import write_demo_dataset
from diffprep.encodings.preencoded import preencoded_fields, sanity_check
from diffprep.run.units import encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.run.energon import finalize
from diffprep.errors import ConfigError, DiffprepError, SourceError
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec, prepare_image, to_uint8
from diffprep.writer.plan import Plan, read_plan, write_plan
from diffprep.writer.shards import load_tensor, read_manifests
from diffprep.sources import Source, open_source
from diffprep.validation import validate_dataset
from diffprep.tasks.common import slug
from latent_direct import ATOL, RTOL

SAMPLES = 12  # demo images, plus one broken file that is rejected


@dataclass
class Dataset:
    out: Path
    data: Path
    settings: Settings
    plan: Plan
    source: Source
    encoders: FluxEncoders


def small_settings(out: Path, data: Path, model: Path) -> Settings:
    overrides = {name: dict(values) for name, values in SMALL_SETTINGS.items()}
    overrides["source"] = {"type": "directory", "input_dir": str(data)}
    overrides["output"]["output_dir"] = str(out)
    overrides["model"]["model_path"] = str(model)
    return load_settings(overrides=overrides)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_model: Path) -> Dataset:
    """12 demo images and one broken file, encoded through the library in 4 units, audited and finalized."""
    root = tmp_path_factory.mktemp("decode")
    data = write_demo_dataset(root / "data", samples=SAMPLES)
    (data / "images" / "00004a-broken.png").write_bytes(b"not a png")
    (data / "captions" / "00004a-broken.txt").write_text("broken")
    out = root / "out"
    settings = small_settings(out, data, tiny_model)
    plan, source = fetch(settings)
    write_plan(out, plan)
    encoders = FluxEncoders.load(settings.model)
    for unit in plan.units:
        encode_unit(out, plan, unit.unit, preencoded_fields(encoders), source, ImageSpec.from_config(settings.image),
                    batch_size=4)
    audit(out, plan)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.5)
    return Dataset(out, data, settings, plan, source, encoders)


def copy_dataset(dataset: Dataset, to: Path) -> Path:
    shutil.copytree(dataset.out, to)
    return to


def edit_plan(out: Path, edit) -> None:
    path = out / contract.STATE_DIR / contract.PLAN_JSON
    plan = json.loads(path.read_text())
    edit(plan)
    path.write_text(json.dumps(plan))


# --- decode ----------------------------------------------------------------------------------------


def test_decode_writes_pngs_a_contact_sheet_and_the_psnr_of_each_sample(dataset: Dataset, tmp_path: Path) -> None:
    to = tmp_path / "decoded"
    report = decode_dataset(dataset.out, 3, to_dir=to, device="cpu")

    keys = [p.key for p in report.previews]
    all_keys = [k for m in read_manifests(dataset.out).values() for k in m.keys]
    assert keys == [all_keys[0], all_keys[4], all_keys[8]]  # spread evenly over the 12 written samples
    assert sorted(p.name for p in to.iterdir()) == sorted(
        [f"{k}.png" for k in keys] + [f"{k}.source.png" for k in keys] + [CONTACT_SHEET])
    assert report.contact_sheet == str(to / CONTACT_SHEET)
    with Image.open(to / CONTACT_SHEET) as sheet:
        assert sheet.format == "PNG" and sheet.width > 2 * 32 and sheet.height > 2 * 32

    stored = {s.key: s for s in read_samples(dataset.out, 3)}
    spec = ImageSpec.from_config(dataset.settings.image)
    for preview in report.previews:
        # The source side is the source file prepared exactly as for encoding.
        source_file = dataset.data / "images" / preview.source_id
        assert torch.equal(preview.source, prepare_image(source_file.read_bytes(), spec).pixels)
        # The decoded side is the encoders' own decode of the stored latents (scale and shift undone).
        latents = load_tensor(stored[preview.key].fields[contract.LATENTS])
        expected = to_uint8(dataset.encoders.decode_latents(latents[None]))[0]
        assert torch.equal(preview.decoded, expected)
        with Image.open(to / f"{preview.key}.png") as png:
            assert torch.equal(torch.from_numpy(np.array(png)).permute(2, 0, 1), expected)
        assert math.isfinite(preview.psnr_db) and 0 < preview.psnr_db < 30
    assert report.psnr_values() == [p.psnr_db for p in report.previews]
    assert report.vae == str(Path(dataset.settings.model.model_path) / "vae")


def test_decode_cli_prints_the_psnr_per_sample(dataset: Dataset, tmp_path: Path, capsys) -> None:
    to = tmp_path / "cli"
    assert main(["decode", str(dataset.out), "--samples", "2", "--to", str(to), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    rows = re.findall(r"^  (\d{6}_\d{6})  PSNR +([0-9.]+) dB  (\S+)$", printed, flags=re.MULTILINE)
    assert len(rows) == 2, printed
    assert all(math.isfinite(float(value)) for _, value, _ in rows)
    assert str(to / CONTACT_SHEET) in printed
    assert len(list(to.glob("[0-9]*.png"))) == 4  # decoded + source for each


def test_decode_without_the_source_still_decodes(dataset: Dataset, tmp_path: Path) -> None:
    out = copy_dataset(dataset, tmp_path / "copy")
    edit_plan(out, lambda plan: plan["source"].update(input_dir=str(tmp_path / "moved-away")))
    report = decode_dataset(out, 2, to_dir=tmp_path / "d", device="cpu")
    assert [p.psnr_db for p in report.previews] == [None, None]
    assert all("source not reachable" in p.note for p in report.previews)
    assert Path(report.contact_sheet).is_file()
    assert "PSNR       n/a" in report.lines()[0]


def test_decode_refuses_a_vae_with_other_scale_and_shift(dataset: Dataset, tmp_path: Path) -> None:
    other = tmp_path / "other-vae"
    shutil.copytree(Path(dataset.settings.model.model_path) / "vae", other)
    config = json.loads((other / "config.json").read_text())
    config["scaling_factor"] = 1.0
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"scaling_factor 1\.0 .* normalized with 0\.3611"):
        decode_dataset(dataset.out, 1, model_path=str(other), device="cpu")
    # The same VAE given explicitly decodes the same pictures as the one plan.json names.
    plain = decode_dataset(dataset.out, 1, device="cpu").previews[0]
    explicit = decode_dataset(dataset.out, 1, model_path=dataset.settings.model.model_path, device="cpu").previews[0]
    assert torch.equal(plain.decoded, explicit.decoded)


def test_decode_without_a_vae_in_the_plan_names_the_flag(dataset: Dataset, tmp_path: Path) -> None:
    out = copy_dataset(dataset, tmp_path / "copy")
    edit_plan(out, lambda plan: plan["settings"].pop("encoders"))
    with pytest.raises(ConfigError, match="--model-path"):
        decode_dataset(out, 1, device="cpu")
    decoder = VaeDecoder.for_plan(read_plan(out), model_path=dataset.settings.model.model_path, device="cpu")
    assert decode_dataset(out, 1, decoder=decoder).previews[0].psnr_db is not None
    # No plan.json at all (a dataset copied without its state): the samples tell the encoding, the VAE is asked for.
    (out / contract.STATE_DIR / contract.PLAN_JSON).unlink()
    with pytest.raises(ConfigError, match="has no plan.json naming its VAE; pass the VAE with --model-path"):
        decode_dataset(out, 1, device="cpu")
    report = decode_dataset(out, 1, model_path=dataset.settings.model.model_path, device="cpu")
    assert report.encoding == contract.ENCODING_PREENCODED and report.previews[0].source is None


def test_local_only_never_downloads_a_hub_vae(dataset: Dataset, tmp_path: Path) -> None:
    out = copy_dataset(dataset, tmp_path / "copy")
    edit_plan(out, lambda plan: plan["settings"]["encoders"]["components"]["vae"].update(
        source="someone/flux-not-cached", commit="0" * 40))
    with pytest.raises(ConfigError, match="someone/flux-not-cached is not in the local cache"):
        decode_dataset(out, 1, device="cpu", local_only=True)


# --- sanity ----------------------------------------------------------------------------------------


def test_sanity_fails_below_min_psnr_and_passes_at_zero(dataset: Dataset, tmp_path: Path) -> None:
    spec = ImageSpec.from_config(dataset.settings.image)
    strict = tmp_path / "strict"
    with pytest.raises(DiffprepError, match=r"round-trip PSNR: median [0-9.]+ dB over 4 images is under "
                                            r"model\.min_psnr 60\.0 dB"):
        sanity_check(strict, dataset.plan, dataset.encoders, dataset.source, spec, batch_size=4, min_psnr=60.0)
    sanity = strict / contract.STATE_DIR / contract.SANITY_DIR
    report = json.loads((sanity / "report.json").read_text())
    assert report["ok"] is False and report["min_psnr"] == 60.0 and len(report["psnr_db"]) == 4
    assert report["contact_sheet"] == str(sanity / CONTACT_SHEET) and (sanity / CONTACT_SHEET).is_file()

    passed = sanity_check(tmp_path / "lenient", dataset.plan, dataset.encoders, dataset.source, spec, batch_size=4,
                          min_psnr=0.0)
    assert passed.ok and passed.psnr_db == report["psnr_db"]  # the same batch, the same numbers
    assert all(isinstance(v, float) and math.isfinite(v) for v in passed.psnr_db)


def test_the_sanity_round_trip_is_said_in_words_and_only_where_there_was_one(dataset: Dataset,
                                                                             tmp_path: Path) -> None:
    """The run's log line and the sanity artifact: PSNRs where a VAE decoded back, "lossless" for a raw png batch
    (None per image, never "[None, None]"), nothing for a run that decodes nothing (an ingest, prompts)."""
    from dataclasses import replace

    from diffprep.run.sanity import round_trip_text, sanity_markdown

    spec = ImageSpec.from_config(dataset.settings.image)
    report = sanity_check(tmp_path / "out", dataset.plan, dataset.encoders, dataset.source, spec, batch_size=4,
                          min_psnr=1.0)
    text = round_trip_text(report.psnr_db, report.min_psnr)
    assert re.fullmatch(r"round-trip PSNR (-?[0-9.]+, ){3}-?[0-9.]+ dB \(the median must reach model\.min_psnr, "
                        r"1\.0 dB\)", text), text
    assert f"| round trip | {text} |" in sanity_markdown(report.to_json())
    lossless = replace(report, psnr_db=[None] * 4, min_psnr=0.0)  # a png run's: every image stored as prepared
    assert round_trip_text(lossless.psnr_db) == "round trip lossless: the 4 stored images give the prepared pixels back"
    assert "None" not in sanity_markdown(lossless.to_json())
    nothing = replace(report, psnr_db=[])
    assert round_trip_text(nothing.psnr_db) is None
    assert "round" not in sanity_markdown(nothing.to_json()) and "PSNR" not in sanity_markdown(nothing.to_json())


@pytest.mark.slow
def test_sanity_threshold_fails_the_flow_and_its_artifact_shows_the_contact_sheet(
        prefect_server, dataset: Dataset, tmp_path: Path, capsys) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    out = tmp_path / "sanity-threshold"
    args = ["encode", "--source-type", "directory", "--input-dir", str(dataset.data),
            "--model-path", dataset.settings.model.model_path, "--output-dir", str(out), "--shard-size", "4",
            "--batch-size", "4", "--precision", "fp32", "--image-size", "32", "--t5-max-length", "16"]
    assert main(args) == 2  # the default threshold: a random-weight VAE does not reconstruct
    err = capsys.readouterr().err
    assert "round-trip PSNR" in err and "model.min_psnr 20.0 dB" in err and "--min-psnr 0" in err
    assert not list(out.glob("*.tar"))  # stopped before any shard

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"sanity-{slug(str(out))}"])))
    assert len(artifacts) == 1
    markdown = artifacts[0].data
    assert "# Sanity check FAILED" in markdown and "min_psnr" in markdown
    assert "![contact sheet](data:image/png;base64," in markdown


# --- validate --------------------------------------------------------------------------------------


def test_validate_summary_matches_the_dataset(dataset: Dataset) -> None:
    out = dataset.out
    report = validate_dataset(out, previews=3, full=True)  # the field counts below are of every sample
    assert report.ok, report.to_markdown()
    s = report.summary
    manifests = read_manifests(out)
    tars = sorted(out.glob("*.tar"))
    info = json.loads((out / contract.NV_META / contract.INFO_JSON).read_text())["shard_counts"]
    split_of = json.loads((out / contract.STATE_DIR / contract.SPLITS_JSON).read_text())["assignment"]

    assert s["encoding"] == "preencoded"
    assert s["shards"] == len(tars) == 4 and s["samples"] == sum(m.count for m in manifests.values()) == SAMPLES
    assert s["bytes"] == sum(p.stat().st_size for p in tars)
    assert s["bytes_per_sample"] == round(s["bytes"] / SAMPLES)
    for split, numbers in s["splits"].items():
        assert numbers["samples"] == sum(info[name] for name, p in split_of.items() if p == split)
        assert numbers["shards"] == sum(1 for p in split_of.values() if p == split)
    assert sum(n["samples"] for n in s["splits"].values()) == SAMPLES
    assert s["fields"]["latents"] == {"shapes": {"16x4x4": SAMPLES}, "dtypes": {"float32": SAMPLES}}
    assert s["fields"]["prompt_embeds"]["shapes"] == {"16x32": SAMPLES}
    assert s["rejects"] == {"inputs": SAMPLES + 1, "rejected": 1, "by_reason": {"image_decode_error": 1}}

    # Latent statistics: per channel over every latent value of every sample, read straight from the tars.
    latents = torch.stack([load_tensor(s_.fields[contract.LATENTS]).double()
                           for s_ in read_samples(out, SAMPLES)])
    per_channel = latents.transpose(0, 1).reshape(16, -1)
    assert s["latent_stats"]["mean"] == pytest.approx(per_channel.mean(dim=1).tolist(), rel=RTOL, abs=ATOL)
    assert s["latent_stats"]["std"] == pytest.approx(per_channel.std(dim=1, correction=0).tolist(), rel=RTOL, abs=ATOL)

    # Previews: the PSNR of a few samples, the same numbers `diffprep decode` gives, and the contact sheet.
    previews = s["previews"]
    decoded = decode_dataset(out, 3, device="cpu")
    assert [p["psnr_db"] for p in previews["samples"]] == [round(p.psnr_db, 2) for p in decoded.previews]
    assert previews["contact_sheet"] == str(out / contract.STATE_DIR / CONTACT_SHEET)
    assert Path(previews["contact_sheet"]).is_file()
    assert json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())["summary"] == \
        json.loads(json.dumps(s))

    text = report.to_markdown()
    assert "| rejected | 1 of 13 inputs: `image_decode_error` 1 |" in text
    assert "## Previews" in text and f"`{previews['contact_sheet']}`" in text and "base64" not in text
    assert "![contact sheet](data:image/png;base64," in report.to_markdown(pictures=True)


def test_validate_without_a_reachable_vae_skips_previews_with_a_note(dataset: Dataset, tmp_path: Path) -> None:
    out = copy_dataset(dataset, tmp_path / "copy")
    edit_plan(out, lambda plan: plan["settings"]["encoders"]["components"]["vae"].update(
        source=str(tmp_path / "no-model")))
    report = validate_dataset(out, previews=2)
    assert report.ok, report.to_markdown()
    assert report.summary["previews"]["note"].startswith("no previews: VAE:")  # in words, no class name
    assert "no previews" in report.to_markdown()


def test_contact_sheet_png_is_embedded_small(dataset: Dataset, tmp_path: Path) -> None:
    from diffprep.report.pictures import MAX_EMBED_BYTES, markdown_image

    report = decode_dataset(dataset.out, 4, sheet=tmp_path / "sheet.png", device="cpu")
    markdown = markdown_image(report.contact_sheet)
    assert markdown.startswith("![contact sheet](data:image/png;base64,") and str(tmp_path / "sheet.png") in markdown
    big = tmp_path / "big.png"
    noise = (torch.rand(3, 600, 600) * 255).to(torch.uint8)
    Image.fromarray(noise.permute(1, 2, 0).numpy()).save(big)
    assert big.stat().st_size > MAX_EMBED_BYTES
    assert markdown_image(big).startswith("![contact sheet](data:image/jpeg;base64,")


# --- reopening a plan's source ---------------------------------------------------------------------


def _directory_source(tmp_path: Path) -> SourceConfig:
    return SourceConfig(type="directory", input_dir=str(write_demo_dataset(tmp_path / "dir", samples=2)))


def _webdataset_source(tmp_path: Path) -> SourceConfig:
    data = write_demo_dataset(tmp_path / "dir", samples=2)
    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        for path in sorted((data / "images").iterdir()) + sorted((data / "captions").iterdir()):
            tar.add(path, arcname=path.name)
    return SourceConfig(type="webdataset", input_path=str(tmp_path / "shard-*.tar"), caption_key="txt")


def _huggingface_source(tmp_path: Path) -> SourceConfig:
    import datasets

    rows = {"image": [Image.new("RGB", (8, 8), (i * 90, 0, 0)) for i in range(2)], "text": ["a", "b"]}
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "rows.parquet"))
    return SourceConfig(type="huggingface", hf_dataset="parquet", hf_data_files=str(tmp_path / "rows.parquet"))


@pytest.mark.parametrize("make", [_directory_source, _webdataset_source, _huggingface_source],
                         ids=["directory", "webdataset", "huggingface"])
def test_a_plans_source_description_reopens_the_same_source(make, tmp_path: Path, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    first = open_source(make(tmp_path))
    again = open_source(source_config(first.describe()))
    assert again.describe() == first.describe()
    ids = list(first.list_ids())
    assert list(again.list_ids()) == ids
    assert [s.image for s in again.read(ids)] == [s.image for s in first.read(ids)]
    with pytest.raises(SourceError, match="type 'ftp'"):
        source_config({"type": "ftp"})


@pytest.mark.parametrize("count, size", [(24, (1440 + 256, 1760)), (256, (1998 + 256, 2040))])
def test_a_scenes_cameras_picture_is_a_grid_of_bounded_size(count: int, size: tuple[int, int]) -> None:
    """`<key>.cameras.png`: the camera views above the frames in rows (24 frames of 352x288: 5 x 5 at full size;
    256: 15 x 18, shrunk to fit 2048 px), never one strip that grows with every frame (24 frames: 8,704 px wide)."""
    from diffprep.report.camera_pictures import PANEL
    from diffprep.validation.decode import camera_picture

    frames = torch.arange(count, dtype=torch.uint8).view(count, 1, 1, 1).expand(count, 3, 288, 352).contiguous()
    c2w = np.tile(np.eye(4), (count, 1, 1))
    c2w[:, 0, 3] = np.linspace(0.0, 1.0, count)  # a dolly along x
    rows = np.tile([300.0, 300.0, 176.0, 144.0], (count, 1))
    picture = camera_picture(frames, c2w, rows, {"width": 352, "height": 288})
    assert tuple(picture.shape) == (3, *size) and picture.shape[2] <= 2048
    columns = 5 if count == 24 else 15
    tile_w, tile_h = (352, 288) if count == 24 else (136, 111)
    last = count - 1  # read left to right, then down: the last frame's tile, under the camera views
    centre = (PANEL + (last // columns) * tile_h + tile_h // 2, (last % columns) * tile_w + tile_w // 2)
    assert picture[:, centre[0], centre[1]].tolist() == [last] * 3
    assert picture[:, PANEL + tile_h // 2, tile_w // 2].tolist() == [0, 0, 0]
