"""Bad inputs through the real pipeline: every sample ends in a shard or in the rejects, with a reason.

Each source type gets one library run (fetch, plan, encode every unit, audit)
with the tiny model over a source full of broken and unusual samples; the
tests then look up each sample's outcome by its source id. The directory
source holds every image and caption case and is encoded twice, at variable
and at fixed size; the webdataset and Hugging Face sources hold the cases
only they can have (unsafe member paths, dotted keys, a row without an image).

The promise checked everywhere: the run finishes, the audit has no problems,
and inputs == written + rejected, so nothing is silently dropped.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from webdataset.tariterators import base_plus_ext

from conftest import SMALL_SETTINGS
from diffprep import contract
from diffprep.phases.audit import AuditReport, audit
from diffprep.config import ModelConfig, Settings, load_settings
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.units import encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.writer.plan import Plan, write_plan
from diffprep.writer.shards import read_manifests
from diffprep.sources.directory import CAPTION_ONLY_PREFIX
from diffprep.sources.webdataset import split_member_name

T5_LENGTH = SMALL_SETTINGS["model"]["t5_max_length"]
MAX_PIXELS = 100_000  # image.max_pixels of every run here: the "bomb" is over it, the panorama under
VARIABLE = {"variable_size": True, "max_size": 64, "max_pixels": MAX_PIXELS}
FIXED = {"variable_size": False, "image_size": 32, "center_crop": True, "max_pixels": MAX_PIXELS}
LONG_CAPTION = " ".join(["a red cat sitting on a blue chair"] * 4)  # 33 tiny-T5 tokens, over T5_LENGTH


@pytest.fixture(scope="module")
def encoders(tiny_model: Path) -> FluxEncoders:
    model = ModelConfig(model_path=str(tiny_model), precision="fp32", device="cpu", t5_max_length=T5_LENGTH)
    return FluxEncoders.load(model)


# --- running the pipeline and reading back what each sample became -----------------------------------


@dataclass
class Run:
    out: Path
    plan: Plan
    report: AuditReport
    rejects: dict[str, tuple[str, str, str]]  # source id -> (reason, phase, detail)
    written: dict[str, dict[str, bytes]]  # source id -> its fields in the shard
    notes: dict[str, int]  # summed over the unit manifests

    def outcome(self, source_id: str) -> str:
        """``written`` or the reject reason; fails when the sample is in neither (a silent drop)."""
        if source_id in self.written:
            return "written"
        assert source_id in self.rejects, f"{source_id!r} is neither written nor rejected"
        return self.rejects[source_id][0]

    def meta(self, source_id: str) -> dict:
        return json.loads(self.written[source_id][contract.META])

    def shape(self, source_id: str, field: str = contract.LATENTS) -> list[int]:
        return list(torch.load(io.BytesIO(self.written[source_id][field]), weights_only=True).shape)


def small_settings(out_dir: Path, model_path: Path, **sections: dict) -> Settings:
    """conftest's SMALL_SETTINGS (fp32 on the CPU, T5 length 16, batches of 4) with 8 samples per unit.

    A function rather than conftest's ``settings_for``: a module-scoped run cannot use a function-scoped fixture.
    """
    overrides = {name: dict(values) for name, values in SMALL_SETTINGS.items()}
    overrides["output"].update(output_dir=str(out_dir), shard_size=8)
    overrides["model"]["model_path"] = str(model_path)
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return load_settings(overrides=overrides)


def run_pipeline(settings: Settings, encoders: FluxEncoders) -> Run:
    """The library path of a run: fetch, write the plan, encode every unit, audit."""
    out = Path(settings.output.output_dir)
    plan, source = fetch(settings)
    write_plan(out, plan)
    spec = ImageSpec.from_config(settings.image)
    for unit in plan.units:
        encode_unit(out, plan, unit.unit, preencoded_fields(encoders), source, spec,
                    batch_size=settings.model.batch_size, decode_workers=1)
    report = audit(out, plan)

    rejects: dict[str, tuple[str, str, str]] = {}
    written: dict[str, dict[str, bytes]] = {}
    notes: Counter[str] = Counter()
    for manifest in read_manifests(out).values():
        for reject in manifest.rejects:
            rejects[reject.source_id] = (reject.reason, reject.phase, reject.detail)
        notes.update(manifest.notes)
        fields_by_key: dict[str, dict[str, bytes]] = {}
        with tarfile.open(out / manifest.shard) as tar:
            for member in tar:
                key, _, field = member.name.partition(".")
                fields_by_key.setdefault(key, {})[field] = tar.extractfile(member).read()
        for key, source_id in zip(manifest.keys, manifest.source_ids, strict=True):
            fields = fields_by_key[key]
            assert json.loads(fields[contract.META])["source_id"] == source_id
            written[source_id] = fields
    return Run(out, plan, report, rejects, written, dict(notes))


def assert_nothing_lost(run: Run) -> None:
    report = run.report
    assert report.problems == []
    assert report.inputs == run.plan.total_samples == report.written + report.rejected
    assert report.written == len(run.written) and report.rejected == len(run.rejects)
    planned = {sid for unit in run.plan.units for sid in unit.source_ids}
    assert set(run.written) | set(run.rejects) == planned
    assert not set(run.written) & set(run.rejects)
    audited = json.loads((run.out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert audited["ok"] is True and audited["by_reason"] == report.by_reason


# --- image bytes -------------------------------------------------------------------------------------


def encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random pixels: they do not compress, so half of the file is half of the image data."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def exif_rotated_jpeg() -> bytes:
    """Stored 64 wide and 32 high, with EXIF orientation 6: upright it is 32 wide and 64 high."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(noise(64, 32, seed=1), "JPEG", quality=95, exif=exif)


def palette_png() -> bytes:
    img = Image.new("P", (32, 32))
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    img.paste(1, (8, 8, 24, 24))
    return encoded(img, "PNG")


# --- the directory source --------------------------------------------------------------------------

ORPHAN_CAPTION = CAPTION_ONLY_PREFIX + "orphan.txt"

# Source id -> reject reason, for every sample that must be rejected.
DIRECTORY_REJECTS = {
    "truncated.jpg": "image_truncated",
    "truncated.png": "image_truncated",
    "zero_bytes.png": "empty_file",
    "text_named.jpg": "image_decode_error",
    "bomb.png": "image_too_large",
    "bad_utf8.png": "caption_decode_error",
    "no_caption.png": "missing_caption",
    ORPHAN_CAPTION: "missing_image",
}
DIRECTORY_KEPT = (
    "SHOUT.PNG", "UPPER.JPG", "blank_caption.png", "cmyk.jpg", "empty_caption.png", "exif6.jpg", "grey16.png",
    "grey8.png", "long_caption.png", "ok.png", "one_pixel.png", "palette.png", "panorama.png", "rgba.png",
    "twin.jpg", "twin.png",
)


def write_bad_directory(root: Path) -> Path:
    images, captions = root / "images", root / "captions"
    images.mkdir(parents=True)
    captions.mkdir()
    jpeg, png = encoded(noise(64, 64), "JPEG", quality=90), encoded(noise(64, 64), "PNG")
    grey16 = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64
    files = {
        "ok.png": encoded(noise(32, 32, seed=2), "PNG"),
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "truncated.png": png[: len(png) // 2],
        "zero_bytes.png": b"",
        "text_named.jpg": b"this is a text file, not a JPEG\n",
        "cmyk.jpg": encoded(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95),
        "grey16.png": encoded(Image.fromarray(grey16), "PNG"),
        "grey8.png": encoded(Image.new("L", (32, 32), 128), "PNG"),
        "rgba.png": encoded(Image.new("RGBA", (32, 32), (255, 0, 0, 128)), "PNG"),
        "palette.png": palette_png(),
        "exif6.jpg": exif_rotated_jpeg(),
        "one_pixel.png": encoded(Image.new("RGB", (1, 1), (9, 99, 199)), "PNG"),
        "bomb.png": encoded(Image.new("RGB", (400, 400)), "PNG"),  # 160 000 pixels > MAX_PIXELS, 1 kB on disk
        "panorama.png": encoded(noise(4000, 20, seed=3), "PNG"),  # 200:1, 80 000 pixels < MAX_PIXELS
        "bad_utf8.png": encoded(noise(32, 32, seed=4), "PNG"),
        "empty_caption.png": encoded(noise(32, 32, seed=5), "PNG"),
        "blank_caption.png": encoded(noise(32, 32, seed=6), "PNG"),
        "long_caption.png": encoded(noise(32, 32, seed=7), "PNG"),
        "no_caption.png": encoded(noise(32, 32, seed=8), "PNG"),
        "twin.jpg": encoded(noise(32, 32, seed=9), "JPEG"),
        "twin.png": encoded(noise(32, 32, seed=10), "PNG"),
        "UPPER.JPG": encoded(noise(32, 32, seed=11), "JPEG"),
        "SHOUT.PNG": encoded(noise(32, 32, seed=12), "PNG"),
    }
    for name, data in files.items():
        (images / name).write_bytes(data)
    special = {
        "bad_utf8": b"caf\xe9 au lait",  # Latin-1, not UTF-8
        "empty_caption": b"",
        "blank_caption": b"  \n\t \n",
        "long_caption": LONG_CAPTION.encode(),
        "twin": b"a twin photo",
        "orphan": b"a caption without its image",
    }
    stems = {Path(name).stem for name in files} - {"no_caption"}
    for stem in stems | set(special):
        (captions / f"{stem}.txt").write_bytes(special.get(stem, b"a small photo"))
    return root


@pytest.fixture(scope="module", params=["variable", "fixed"])
def directory_run(request, tmp_path_factory, tiny_model: Path, encoders: FluxEncoders) -> Run:
    """One run per image mode over the directory of bad inputs, shared by the tests of that mode."""
    root = tmp_path_factory.mktemp(f"dir-{request.param}")
    data = write_bad_directory(root / "data")
    image = VARIABLE if request.param == "variable" else FIXED
    settings = small_settings(root / "out", tiny_model, image=image,
                              source={"type": "directory", "input_dir": str(data)})
    return run_pipeline(settings, encoders)


def test_directory_run_accounts_for_every_sample(directory_run: Run) -> None:
    assert_nothing_lost(directory_run)
    assert len(directory_run.plan.units) == 3  # 24 samples, 8 per unit
    assert {sid: directory_run.outcome(sid) for sid in DIRECTORY_REJECTS} == DIRECTORY_REJECTS
    assert sorted(directory_run.written) == sorted(DIRECTORY_KEPT)
    assert directory_run.report.by_reason == dict(Counter(DIRECTORY_REJECTS.values()))
    upscaled = sum("upscaled" in directory_run.meta(sid)["notes"] for sid in directory_run.written)
    assert directory_run.report.notes == directory_run.notes == {"caption_truncated": 1, "empty_caption": 2,
                                                                 "image_upscaled": upscaled}


def test_every_written_sample_has_the_planned_shapes_and_finite_values(directory_run: Run) -> None:
    expected = directory_run.plan.expected
    assert sorted(directory_run.written) == sorted(DIRECTORY_KEPT)  # the loop below checks every kept sample
    for source_id, fields in directory_run.written.items():
        for field in contract.TENSOR_FIELDS:
            tensor = torch.load(io.BytesIO(fields[field]), weights_only=True)
            want = expected[contract.field_stem(field)]
            have = list(tensor.shape)
            assert len(have) == len(want) and all(w is None or w == h for w, h in zip(want, have)), source_id
            assert bool(torch.isfinite(tensor).all()), source_id


def test_broken_image_files_are_rejected_at_decode_with_a_reason(directory_run: Run) -> None:
    rejects = directory_run.rejects
    for source_id in ("truncated.jpg", "truncated.png", "zero_bytes.png", "text_named.jpg", "bomb.png"):
        assert rejects[source_id][1] == "decode"
    assert "truncated" in rejects["truncated.jpg"][2] and "truncated" in rejects["truncated.png"][2]
    assert "0 bytes" in rejects["zero_bytes.png"][2]
    assert "cannot identify image file" in rejects["text_named.jpg"][2]
    assert "b'this is a text f" in rejects["text_named.jpg"][2]  # the first bytes show what the file is
    assert f"400x400 = 160000 pixels is over image.max_pixels = {MAX_PIXELS}" in rejects["bomb.png"][2]


def test_caption_problems_are_rejected_at_read_naming_the_file(directory_run: Run) -> None:
    rejects = directory_run.rejects
    reason, phase, detail = rejects["bad_utf8.png"]
    assert (reason, phase) == ("caption_decode_error", "read")
    assert "bad_utf8.txt: invalid UTF-8 at byte offset 3" in detail
    reason, phase, detail = rejects["no_caption.png"]
    assert (reason, phase) == ("missing_caption", "read")
    assert detail.endswith(os.path.join("captions", "no_caption.txt"))
    reason, phase, detail = rejects[ORPHAN_CAPTION]
    assert (reason, phase) == ("missing_image", "read")
    assert "orphan.txt has no image images/orphan." in detail


@pytest.mark.parametrize(
    "source_id, notes",
    [
        ("cmyk.jpg", ["mode:CMYK->RGB"]),
        ("grey16.png", ["mode:I;16->RGB(>>8)"]),
        ("grey8.png", ["mode:L->RGB"]),
        ("rgba.png", ["mode:RGBA->RGB", "alpha_composited"]),
        ("palette.png", ["mode:P->RGB"]),
        ("ok.png", []),
    ],
)
def test_image_modes_are_kept_and_converted(directory_run: Run, source_id: str, notes: list[str]) -> None:
    meta = directory_run.meta(source_id)
    assert meta["notes"] == notes
    assert meta["original_size"] == [32, 32]


def test_exif_rotated_jpeg_is_stored_upright(directory_run: Run) -> None:
    meta = directory_run.meta("exif6.jpg")
    assert "exif_transposed" in meta["notes"]
    assert meta["original_size"] == [32, 64]  # (width, height) upright; the file stores 64 x 32
    if directory_run.plan.settings["image"]["variable_size"]:
        # Upright 32 wide, 64 high -> latents [16, 64/8, 32/8]; stored as is it would be [16, 4, 8].
        assert meta["size"] == [32, 64] and meta["crop_box"] == [0, 0, 32, 64]
        assert directory_run.shape("exif6.jpg") == [16, 8, 4]
    else:
        assert meta["size"] == [32, 32] and meta["crop_box"] == [0, 16, 32, 48]  # the upright center square
        assert directory_run.shape("exif6.jpg") == [16, 4, 4]


def test_one_pixel_image_is_kept(directory_run: Run) -> None:
    meta = directory_run.meta("one_pixel.png")
    assert meta["original_size"] == [1, 1] and meta["crop_box"] == [0, 0, 1, 1]
    assert "upscaled" in meta["notes"]  # kept, and counted as image_upscaled
    if directory_run.plan.settings["image"]["variable_size"]:
        assert meta["size"] == [16, 16] and directory_run.shape("one_pixel.png") == [16, 2, 2]
    else:
        assert meta["size"] == [32, 32] and directory_run.shape("one_pixel.png") == [16, 4, 4]


def test_very_wide_panorama_is_kept(directory_run: Run) -> None:
    meta = directory_run.meta("panorama.png")
    assert meta["original_size"] == [4000, 20]
    if directory_run.plan.settings["image"]["variable_size"]:
        # The short side is lifted to 16 (scale 16/20), the long side center-cropped to max_size.
        assert meta["size"] == [64, 16] and meta["crop_box"] == [1960, 0, 2040, 20]
        assert directory_run.shape("panorama.png") == [16, 2, 8]
    else:
        assert meta["size"] == [32, 32] and meta["crop_box"] == [1990, 0, 2010, 20]
        assert directory_run.shape("panorama.png") == [16, 4, 4]


def test_empty_and_long_captions_are_kept_and_counted(directory_run: Run) -> None:
    written = directory_run.written
    assert written["empty_caption.png"][contract.CAPTION] == b""
    assert written["blank_caption.png"][contract.CAPTION] == b""
    assert written["long_caption.png"][contract.CAPTION].decode() == LONG_CAPTION  # stored in full
    assert directory_run.shape("long_caption.png", contract.PROMPT_EMBEDS) == [T5_LENGTH, 32]
    assert {k: v for k, v in directory_run.report.notes.items() if k != "image_upscaled"} == {
        "caption_truncated": 1, "empty_caption": 2}


def test_same_stem_and_upper_case_extensions_are_all_kept(directory_run: Run) -> None:
    written = directory_run.written
    assert written["twin.jpg"][contract.CAPTION] == written["twin.png"][contract.CAPTION] == b"a twin photo"
    assert written["twin.jpg"][contract.LATENTS] != written["twin.png"][contract.LATENTS]  # two images
    assert written["UPPER.JPG"][contract.CAPTION] == written["SHOUT.PNG"][contract.CAPTION] == b"a small photo"


# --- the webdataset source -------------------------------------------------------------------------


def tar_with(path: Path, members: dict[str, bytes]) -> Path:
    """A tar whose member names are taken exactly as given (tarfile.add would strip a leading '/')."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tree(root: Path, skip: Path) -> set[str]:
    """Every path under ``root`` except those under ``skip``."""
    paths = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) != skip]
        paths.update(os.path.join(folder, name) for name in dirs + files)
    return paths


def test_webdataset_unsafe_paths_and_dotted_keys(tmp_path_factory, tiny_model: Path, encoders: FluxEncoders) -> None:
    root = tmp_path_factory.mktemp("wds")
    outside = root.parent  # pytest's base temp folder: where a "../" or absolute member would escape to
    absolute = str(outside / "escaped-absolute")
    image = encoded(noise(32, 32), "PNG")
    shards = root / "shards"
    shards.mkdir()
    tar_with(shards / "data.tar", {
        "good.png": image, "good.txt": b"a good sample",
        "../escaped-dotdot.png": image, "../escaped-dotdot.txt": b"climbs out of the folder",
        "sub/../../escaped-nested.png": image, "sub/../../escaped-nested.txt": b"climbs out two levels",
        f"{absolute}.png": image, f"{absolute}.txt": b"an absolute path",
        # A dot in a folder name stays in the key: key "photos.2024/cat", extension "png".
        "photos.2024/cat.png": image, "photos.2024/cat.txt": b"a dotted folder",
        # A dot in the base name ends the key: key "cat", extensions "v2.png" and "v2.txt" (not png, txt).
        "cat.v2.png": image, "cat.v2.txt": b"a dotted base name",
        "upper.PNG": image, "upper.TXT": b"upper-case extensions",  # extensions are lower-cased
    })
    out = root / "out"
    before = tree(outside, skip=out)
    settings = small_settings(out, tiny_model, image=FIXED,
                              source={"type": "webdataset", "input_path": str(shards / "*.tar")})

    run = run_pipeline(settings, encoders)

    assert_nothing_lost(run)
    assert tree(outside, skip=out) == before  # nothing written outside the output folder
    assert {sid: run.outcome(sid) for sid in run.plan.units[0].source_ids} == {
        "data.tar/good": "written",
        "data.tar/../escaped-dotdot": "unsafe_member_path",
        "data.tar/sub/../../escaped-nested": "unsafe_member_path",
        f"data.tar/{absolute}": "unsafe_member_path",
        "data.tar/photos.2024/cat": "written",
        "data.tar/cat": "missing_image",
        "data.tar/upper": "written",
    }
    assert run.written["data.tar/photos.2024/cat"][contract.CAPTION] == b"a dotted folder"
    # webdataset's own rule, which the source follows: everything after the base name's first dot is the
    # extension. The sample is rejected with its members named (fix: source.image_key "v2.png"), not dropped.
    assert base_plus_ext("cat.v2.png") == ("cat", "v2.png") and split_member_name("cat.v2.png") == ("cat", "v2.png")
    assert base_plus_ext("photos.2024/cat.png") == ("photos.2024/cat", "png")
    assert "members are ['v2.png', 'v2.txt']" in run.rejects["data.tar/cat"][2]
    assert "absolute or has '..'" in run.rejects["data.tar/../escaped-dotdot"][2]
    # Output keys never carry the source's dots: <unit>_<index> only.
    assert all(contract.parse_sample_key(key) for key in read_manifests(run.out)[0].keys)


# --- the Hugging Face source -----------------------------------------------------------------------


def test_hf_rows_without_image_or_caption_are_rejected(tmp_path_factory, tiny_model: Path,
                                                       encoders: FluxEncoders) -> None:
    root = tmp_path_factory.mktemp("hf")
    png = encoded(noise(32, 32), "PNG")
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    table = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": png, "path": None}, None, {"bytes": png, "path": None}],
            "text": ["a good row", "a row whose image is missing", None],
        },
        features=features,
    )
    table.save_to_disk(str(root / "saved"))
    settings = small_settings(root / "out", tiny_model, image=FIXED,
                              source={"type": "huggingface", "hf_dataset": str(root / "saved")})

    run = run_pipeline(settings, encoders)

    assert_nothing_lost(run)
    assert {sid: run.outcome(sid) for sid in ("train/0", "train/1", "train/2")} == {
        "train/0": "written", "train/1": "missing_image", "train/2": "missing_caption",
    }
    reason, phase, detail = run.rejects["train/1"]
    assert phase == "read" and "no image in 'image'" in detail
    assert run.written["train/0"][contract.CAPTION] == b"a good row"
