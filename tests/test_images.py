"""diffprep.media.images on real encoded files built in memory with Pillow (small sizes, fast)."""

from __future__ import annotations

import io
import math
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from diffprep.config import ImageConfig
from diffprep.errors import ConfigError, RejectError
from diffprep.media.images import ImageSpec, PreparedImage, prepare_image, psnr, target_size, to_model_input, to_uint8

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
# Variable size with max_size above the test images: multiple-of-16 sources come out pixel for pixel.
EXACT = ImageSpec(variable_size=True, max_size=256)


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def hwc(prepared: PreparedImage) -> np.ndarray:
    """Output pixels as an [H, W, 3] numpy array, for comparing with Pillow images."""
    return prepared.pixels.permute(1, 2, 0).numpy()


def reject_of(data: bytes, spec: ImageSpec = EXACT) -> RejectError:
    with pytest.raises(RejectError) as info:
        prepare_image(data, spec)
    assert info.value.phase == "decode"
    return info.value


def random_rgb(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says width x height but which holds the pixel data of a 1x1 image.

    Decoding it would fail, so a size rejection proves the check ran on the header alone.
    """
    data = bytearray(encode(Image.new("RGB", (1, 1)), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# --- formats and output form ------------------------------------------------------------------


@pytest.mark.parametrize("fmt, tolerance", [("PNG", 0), ("JPEG", 8), ("WEBP", 8)])
def test_common_formats_decode_to_uint8_chw(fmt: str, tolerance: int) -> None:
    source = np.zeros((32, 48, 3), dtype=np.uint8)
    source[:, :24] = RED
    source[:, 24:] = (40, 90, 200)
    kwargs = {"quality": 95} if fmt != "PNG" else {}
    result = prepare_image(encode(Image.fromarray(source), fmt, **kwargs), EXACT)

    assert result.pixels.dtype == torch.uint8
    assert result.pixels.shape == (3, 32, 48)
    assert result.pixels.is_contiguous()
    assert result.original_size == (48, 32)
    assert result.crop_box == (0, 0, 48, 32)
    assert result.notes == ()
    # Away from the colour edge (lossy codecs blur it), the colours survive.
    diff = np.abs(hwc(result).astype(int) - source.astype(int))
    assert diff[:, :20].max() <= tolerance and diff[:, 28:].max() <= tolerance


def test_same_bytes_same_pixels() -> None:
    data = encode(Image.fromarray(random_rgb(70, 45)), "JPEG")
    fixed, stretched = ImageSpec(image_size=32), ImageSpec(image_size=32, center_crop=False)
    for spec in (fixed, stretched, ImageSpec(variable_size=True, max_size=48)):
        first, second = prepare_image(data, spec), prepare_image(data, spec)
        assert torch.equal(first.pixels, second.pixels)
        assert first.crop_box == second.crop_box


# --- rejects ----------------------------------------------------------------------------------


def test_empty_bytes_are_rejected_as_empty_file() -> None:
    assert reject_of(b"").reason == "empty_file"


def test_text_named_jpg_is_a_decode_error_with_pillows_words() -> None:
    err = reject_of(b"<!DOCTYPE html><html>404 not found</html>")
    assert err.reason == "image_decode_error"
    assert "cannot identify image file" in err.detail
    assert "<!DOCTYPE" in err.detail  # the first bytes show what the file really is
    assert "0x" not in err.detail  # no memory address: the same file gives the same reject text every run


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_files_are_rejected_as_truncated(fmt: str) -> None:
    data = encode(Image.fromarray(random_rgb(64, 64)), fmt)
    err = reject_of(data[: len(data) // 2])
    assert err.reason == "image_truncated"
    assert "truncated" in err.detail


def test_images_over_max_pixels_are_rejected_naming_size_limit_and_setting() -> None:
    data = encode(Image.new("RGB", (11, 10)), "PNG")
    err = reject_of(data, ImageSpec(max_pixels=109))
    assert err.reason == "image_too_large"
    assert "11x10" in err.detail and "110" in err.detail and "109" in err.detail
    assert "image.max_pixels" in err.detail
    assert prepare_image(data, ImageSpec(image_size=16, max_pixels=110)).pixels.shape == (3, 16, 16)


def test_max_pixels_is_checked_on_the_header_before_decoding() -> None:
    # 5000x5000 would be 75 MB of pixels; the file holds a 1x1 image, so only a header check can say "too large".
    err = reject_of(png_header_claiming(5000, 5000), ImageSpec(max_pixels=1_000_000))
    assert err.reason == "image_too_large"
    assert "5000x5000" in err.detail


def test_pillow_bomb_error_becomes_a_reject() -> None:
    # Over twice Pillow's global MAX_IMAGE_PIXELS: Image.open itself raises DecompressionBombError.
    err = reject_of(png_header_claiming(20_000, 20_000), ImageSpec())
    assert err.reason == "image_too_large"
    assert "MAX_IMAGE_PIXELS" in err.detail
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # global state untouched


def test_pillow_bomb_warning_becomes_a_reject_even_when_warnings_are_errors() -> None:
    data = png_header_claiming(10_000, 10_000)  # between Pillow's warning and error thresholds
    with pytest.warns(Image.DecompressionBombWarning):
        assert reject_of(data, ImageSpec()).reason == "image_too_large"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reject_of(data, ImageSpec()).reason == "image_too_large"


def test_eps_is_refused_because_pillow_runs_ghostscript_on_it() -> None:
    assert reject_of(encode(Image.new("RGB", (16, 16)), "EPS")).reason == "image_decode_error"


# --- modes ------------------------------------------------------------------------------------


def test_cmyk_jpeg_becomes_rgb() -> None:
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # pure red; Pillow writes an Adobe (inverted) JPEG
    result = prepare_image(encode(cmyk, "JPEG", quality=95), EXACT)
    assert "mode:CMYK->RGB" in result.notes
    assert np.abs(hwc(result).astype(int) - np.array(RED)).max() <= 8


def test_16_bit_png_is_scaled_by_its_high_byte_not_clipped() -> None:
    values = [0, 255, 256, 32767, 32768, 65280, 65535]
    grid = np.zeros((16, 16), dtype=np.uint16)
    grid[0, : len(values)] = values
    img = Image.fromarray(grid)
    assert img.mode == "I;16"
    data = encode(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"

    result = prepare_image(data, EXACT)
    assert result.notes == ("mode:I;16->RGB(>>8)",)
    out = hwc(result)
    assert out[0, : len(values)].tolist() == [[v, v, v] for v in (0, 0, 1, 127, 128, 255, 255)]


def test_32_bit_integer_tiff_is_read_as_16_bit_samples() -> None:
    grid = np.full((16, 16), 65535, dtype=np.int32)
    grid[0, 0], grid[0, 1], grid[0, 2] = 32768, -5, 100_000
    data = encode(Image.fromarray(grid, mode="I"), "TIFF")
    out = hwc(prepare_image(data, EXACT))
    assert out[0, :4, 0].tolist() == [128, 0, 255, 255]


@pytest.mark.parametrize(
    "scale, note",
    [(1.0, "mode:F->RGB(0..1)"), (255.0, "mode:F->RGB(0..255)")],
)
def test_float_tiff_in_either_range(scale: float, note: str) -> None:
    grid = np.full((16, 16), 0.5, dtype=np.float32) * scale
    grid[0, 0] = 1.0 * scale
    result = prepare_image(encode(Image.fromarray(grid, mode="F"), "TIFF"), EXACT)
    assert result.notes == (note,)
    out = hwc(result)
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[5, 5].tolist() == [128, 128, 128]  # 127.5 -> 128


def test_greyscale_is_replicated_to_three_channels() -> None:
    grey = random_rgb(32, 16)[:, :, 0]
    result = prepare_image(encode(Image.fromarray(grey, mode="L"), "PNG"), EXACT)
    assert result.notes == ("mode:L->RGB",)
    out = hwc(result)
    for channel in range(3):
        assert np.array_equal(out[:, :, channel], grey)


def test_one_bit_image_becomes_black_and_white() -> None:
    img = Image.new("1", (16, 16), 0)
    img.putpixel((3, 2), 1)
    out = hwc(prepare_image(encode(img, "PNG"), EXACT))
    assert out[2, 3].tolist() == [255, 255, 255]
    assert out[0, 0].tolist() == [0, 0, 0]


def test_rgba_is_composited_over_the_background() -> None:
    rgba = np.zeros((16, 16, 4), dtype=np.uint8)
    rgba[..., :3] = RED
    rgba[..., 3] = 255
    rgba[0, 0, 3] = 0  # fully transparent
    rgba[0, 1, 3] = 128  # half
    spec = ImageSpec(variable_size=True, max_size=256, background=BLUE)
    result = prepare_image(encode(Image.fromarray(rgba, mode="RGBA"), "PNG"), spec)
    assert result.notes == ("mode:RGBA->RGB", "alpha_composited")
    out = hwc(result)
    assert out[0, 0].tolist() == list(BLUE)
    assert out[5, 5].tolist() == list(RED)
    red, _, blue = out[0, 1].tolist()
    assert abs(red - 128) <= 1 and abs(blue - 127) <= 1


def test_greyscale_with_alpha_is_composited() -> None:
    la = Image.new("LA", (16, 16), (0, 255))
    la.putpixel((4, 4), (0, 0))
    out = hwc(prepare_image(encode(la, "PNG"), EXACT))
    assert out[4, 4].tolist() == [255, 255, 255]  # default background: white
    assert out[0, 0].tolist() == [0, 0, 0]


def test_palette_png_with_transparency_is_composited() -> None:
    pal = Image.new("P", (16, 16), 1)
    pal.putpalette([0, 0, 0, *GREEN] + [0] * (256 - 2) * 3)
    pal.putpixel((2, 3), 0)
    data = encode(pal, "PNG", transparency=0)
    result = prepare_image(data, ImageSpec(variable_size=True, max_size=256, background=(9, 8, 7)))
    assert result.notes == ("mode:P->RGB", "alpha_composited")
    out = hwc(result)
    assert out[3, 2].tolist() == [9, 8, 7]
    assert out[0, 0].tolist() == list(GREEN)


def test_palette_png_without_transparency_is_converted() -> None:
    pal = Image.new("P", (16, 16), 1)
    pal.putpalette([0, 0, 0, *BLUE] + [0] * (256 - 2) * 3)
    result = prepare_image(encode(pal, "PNG"), EXACT)
    assert result.notes == ("mode:P->RGB",)
    assert (hwc(result) == np.array(BLUE, dtype=np.uint8)).all()


def test_16_bit_greyscale_colour_key_is_composited() -> None:
    grid = np.full((16, 16), 65535, dtype=np.uint16)
    grid[1, 1] = 1000
    data = encode(Image.fromarray(grid), "PNG", transparency=1000)
    result = prepare_image(data, ImageSpec(variable_size=True, max_size=256, background=RED))
    assert result.notes == ("mode:I;16->RGB(>>8)", "alpha_composited")
    out = hwc(result)
    assert out[1, 1].tolist() == list(RED)
    assert out[0, 0].tolist() == [255, 255, 255]


def test_rgb_png_colour_key_is_composited() -> None:
    img = Image.new("RGB", (16, 16), BLUE)
    img.putpixel((7, 9), RED)
    spec = ImageSpec(variable_size=True, max_size=256, background=GREEN)
    result = prepare_image(encode(img, "PNG", transparency=RED), spec)
    assert result.notes == ("alpha_composited",)
    out = hwc(result)
    assert out[9, 7].tolist() == list(GREEN)
    assert out[0, 0].tolist() == list(BLUE)


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), colour) for colour in (RED, BLUE)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    result = prepare_image(data, EXACT)
    assert "multiframe:first_frame" in result.notes
    assert (hwc(result) == np.array(RED, dtype=np.uint8)).all()


# --- EXIF orientation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "orientation, corner",
    [
        (6, (0, -1)),  # stored rotated 90° counter-clockwise: displays the stored top-left at the top-right
        (8, (-1, 0)),  # stored rotated 90° clockwise: the stored top-left ends at the bottom-left
        (3, (-1, -1)),  # 180°
    ],
)
def test_exif_rotated_jpeg_comes_out_upright(orientation: int, corner: tuple[int, int]) -> None:
    stored = np.zeros((32, 48, 3), dtype=np.uint8)  # stored 48 wide, 32 high
    stored[:16, :16] = RED  # a red block in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif)

    result = prepare_image(data, EXACT)
    assert "exif_transposed" in result.notes
    out = hwc(result).astype(int)
    expected_size = (32, 48) if orientation in (6, 8) else (48, 32)
    assert result.original_size == expected_size
    assert result.pixels.shape == (3, expected_size[1], expected_size[0])
    rows, cols = out.shape[:2]
    row = 4 if corner[0] == 0 else rows - 5
    col = 4 if corner[1] == 0 else cols - 5
    assert np.abs(out[row, col] - np.array(RED)).max() <= 10
    # ...and nowhere else: the other three corners stay black.
    for r in (4, rows - 5):
        for c in (4, cols - 5):
            if (r, c) != (row, col):
                assert out[r, c].max() <= 10


def test_exif_orientation_1_is_left_alone() -> None:
    exif = Image.Exif()
    exif[0x0112] = 1
    result = prepare_image(encode(Image.new("RGB", (48, 32)), "JPEG", exif=exif), EXACT)
    assert result.notes == ()
    assert result.original_size == (48, 32)


# --- geometry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, spec, expected",
    [
        ((4000, 3000), ImageSpec(), (1024, 1024)),
        ((300, 5000), ImageSpec(image_size=512), (512, 512)),
        ((7, 3), ImageSpec(image_size=256, center_crop=False), (256, 256)),
        ((1024, 768), ImageSpec(variable_size=True), (1024, 768)),
        ((4000, 3000), ImageSpec(variable_size=True), (1024, 768)),
        ((3000, 4000), ImageSpec(variable_size=True), (768, 1024)),
        ((1920, 1080), ImageSpec(variable_size=True), (1024, 576)),
        ((1000, 1000), ImageSpec(variable_size=True), (992, 992)),  # not upscaled, rounded down to 16
        ((500, 333), ImageSpec(variable_size=True, max_size=512), (496, 320)),
        ((100, 50), ImageSpec(variable_size=True), (96, 48)),
        ((1, 1), ImageSpec(variable_size=True), (16, 16)),
        ((17, 15), ImageSpec(variable_size=True), (16, 16)),
        ((10_000, 40), ImageSpec(variable_size=True, max_size=512), (512, 16)),
        ((40, 10_000), ImageSpec(variable_size=True, max_size=512), (16, 512)),
        ((10_000, 100), ImageSpec(variable_size=True), (1024, 16)),
        ((128, 63), ImageSpec(variable_size=True, max_size=64), (64, 32)),  # 31.5 rounds half up to 32
        ((128, 61), ImageSpec(variable_size=True, max_size=64), (64, 16)),  # 30.5 -> 31, down to 16
    ],
)
def test_target_size_table(size: tuple[int, int], spec: ImageSpec, expected: tuple[int, int]) -> None:
    assert target_size(*size, spec) == expected
    assert all(side % 16 == 0 and side >= 16 for side in expected)


def test_fixed_size_center_crop_box_in_source_coordinates() -> None:
    # Three vertical bands; the center square of a 96x32 source is exactly the green band.
    source = np.zeros((32, 96, 3), dtype=np.uint8)
    source[:, :32], source[:, 32:64], source[:, 64:] = RED, GREEN, BLUE
    result = prepare_image(encode(Image.fromarray(source), "PNG"), ImageSpec(image_size=16))
    assert result.crop_box == (32, 0, 64, 32)
    assert result.pixels.shape == (3, 16, 16)
    out = hwc(result).astype(int)
    # LANCZOS sees a few pixels across the box edge; the interior is pure green.
    assert np.abs(out[:, 3:13] - np.array(GREEN)).max() <= 2


def test_fixed_size_odd_leftover_goes_right_and_bottom() -> None:
    assert prepare_image(encode(Image.new("RGB", (33, 16)), "PNG"), ImageSpec(image_size=16)).crop_box == (8, 0, 24, 16)
    assert prepare_image(encode(Image.new("RGB", (16, 33)), "PNG"), ImageSpec(image_size=16)).crop_box == (0, 8, 16, 24)


def test_fixed_size_without_crop_stretches_the_whole_image() -> None:
    source = np.zeros((16, 64, 3), dtype=np.uint8)
    source[:, :32], source[:, 32:] = RED, BLUE
    result = prepare_image(encode(Image.fromarray(source), "PNG"), ImageSpec(image_size=32, center_crop=False))
    assert result.crop_box == (0, 0, 64, 16)
    out = hwc(result).astype(int)
    assert np.abs(out[:, :12] - np.array(RED)).max() <= 2  # both halves present: nothing was cropped
    assert np.abs(out[:, 20:] - np.array(BLUE)).max() <= 2


def test_variable_size_rounds_down_by_cropping_not_rescaling() -> None:
    source = random_rgb(100, 50, seed=3)
    result = prepare_image(encode(Image.fromarray(source), "PNG"), ImageSpec(variable_size=True, max_size=1024))
    assert result.crop_box == (2, 1, 98, 49)
    assert np.array_equal(hwc(result), source[1:49, 2:98])  # scale 1: the output is the crop itself


def test_variable_size_downscale_keeps_aspect() -> None:
    source = random_rgb(200, 100, seed=4)
    result = prepare_image(encode(Image.fromarray(source), "PNG"), ImageSpec(variable_size=True, max_size=64))
    assert result.pixels.shape == (3, 32, 64)
    assert result.crop_box == (0, 0, 200, 100)


@pytest.mark.parametrize(
    "spec, shape, box",
    [
        (ImageSpec(image_size=32), (3, 32, 32), (4980, 0, 5020, 40)),
        (ImageSpec(image_size=32, center_crop=False), (3, 32, 32), (0, 0, 10_000, 40)),
        # Long side to 64 would leave the short side 0.256 px: it is lifted to 16 and the long side cropped.
        (ImageSpec(variable_size=True, max_size=64), (3, 16, 64), (4920, 0, 5080, 40)),
    ],
)
def test_panorama_10000x40(spec: ImageSpec, shape: tuple[int, ...], box: tuple[int, int, int, int]) -> None:
    source = np.zeros((40, 10_000, 3), dtype=np.uint8)
    source[:, :5000] = RED
    source[:, 5000:] = BLUE
    result = prepare_image(encode(Image.fromarray(source), "PNG"), spec)
    assert result.pixels.shape == shape
    assert result.crop_box == box
    assert result.original_size == (10_000, 40)
    out = hwc(result).astype(int)
    assert np.abs(out[:, 0] - np.array(RED)).max() <= 2
    assert np.abs(out[:, -1] - np.array(BLUE)).max() <= 2


@pytest.mark.parametrize(
    "spec, shape",
    [
        (ImageSpec(image_size=32), (3, 32, 32)),
        (ImageSpec(image_size=32, center_crop=False), (3, 32, 32)),
        (ImageSpec(variable_size=True, max_size=64), (3, 16, 16)),
    ],
)
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_one_pixel_image_is_upscaled_in_every_mode(spec: ImageSpec, shape: tuple[int, ...], fmt: str) -> None:
    result = prepare_image(encode(Image.new("RGB", (1, 1), (200, 100, 50)), fmt, quality=100), spec)
    assert result.pixels.shape == shape
    assert result.crop_box == (0, 0, 1, 1)
    colours = hwc(result).reshape(-1, 3)
    assert (colours == colours[0]).all()  # one source pixel: a flat output
    assert np.abs(colours[0].astype(int) - np.array([200, 100, 50])).max() <= 6


# --- spec -------------------------------------------------------------------------------------


def test_spec_from_config_copies_every_field() -> None:
    cfg = ImageConfig(
        image_size=512, center_crop=False, variable_size=True, max_size=768, max_pixels=1000, background=(1, 2, 3)
    )
    spec = ImageSpec.from_config(cfg)
    assert spec == ImageSpec(
        image_size=512, center_crop=False, variable_size=True, max_size=768, max_pixels=1000, background=(1, 2, 3)
    )
    assert ImageSpec.from_config(ImageConfig()) == ImageSpec()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"image_size": 1000}, "image.image_size"),
        ({"max_size": 8}, "image.max_size"),
        ({"max_pixels": 0}, "image.max_pixels"),
        ({"background": (0, 0, 256)}, "image.background"),
        ({"background": (0, 0)}, "image.background"),
    ],
)
def test_spec_refuses_bad_values_naming_the_setting(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ImageSpec(**kwargs)


# --- tensors ----------------------------------------------------------------------------------


def test_to_model_input_range_and_round_trip() -> None:
    every_value = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(2, 3, 16, 16)
    model_input = to_model_input(every_value, torch.float32)
    assert model_input.dtype == torch.float32 and model_input.shape == (2, 3, 16, 16)
    assert model_input.min().item() == -1.0 and model_input.max().item() == 1.0
    assert torch.equal(to_uint8(model_input), every_value)

    single = to_model_input(every_value[0], torch.bfloat16)
    assert single.dtype == torch.bfloat16 and single.shape == (3, 16, 16)
    # bf16 keeps 8 significant bits: the round trip is within one level.
    assert (to_uint8(single).int() - every_value[0].int()).abs().max() <= 1


def test_to_model_input_refuses_wrong_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        to_model_input(torch.zeros(3, 4, 4), torch.float32)
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        to_model_input(torch.zeros(4, 4, 3, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="floating point"):
        to_model_input(torch.zeros(3, 4, 4, dtype=torch.uint8), torch.int32)


def test_to_uint8_clamps_and_refuses_non_finite() -> None:
    assert to_uint8(torch.tensor([-3.0, -1.0, 0.0, 1.0, 5.0])).tolist() == [0, 0, 128, 255, 255]
    with pytest.raises(ValueError, match="non-finite"):
        to_uint8(torch.tensor([0.0, float("nan")]))


def test_psnr() -> None:
    a = torch.zeros(3, 8, 8, dtype=torch.uint8)
    assert psnr(a, a.clone()) == math.inf
    assert psnr(a, a + 1) == pytest.approx(20 * math.log10(255))  # MSE 1
    assert psnr(a, a + 16) < psnr(a, a + 4)
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(a, torch.zeros(3, 8, 9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        psnr(a.float(), a.float())


def test_decode_round_trip_psnr_of_a_prepared_image() -> None:
    pixels = prepare_image(encode(Image.fromarray(random_rgb(32, 32)), "PNG"), EXACT).pixels
    assert psnr(to_uint8(to_model_input(pixels, torch.float32)), pixels) == math.inf
    assert psnr(to_uint8(to_model_input(pixels, torch.float16)), pixels) > 45


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "AVIF"])
def test_every_image_extension_the_sources_list_decodes(fmt: str) -> None:
    prepared = prepare_image(encode(Image.new("RGB", (32, 32), (200, 10, 10)), fmt), ImageSpec(image_size=16))
    assert prepared.pixels.shape == (3, 16, 16)


def test_an_upscaled_image_has_a_note_and_min_size_rejects_it() -> None:
    tiny = encode(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG")
    kept = prepare_image(tiny, ImageSpec(image_size=64))
    assert kept.pixels.shape == (3, 64, 64) and "upscaled" in kept.notes
    assert "upscaled" not in prepare_image(encode(Image.new("RGB", (96, 80)), "PNG"), ImageSpec(image_size=64)).notes
    with pytest.raises(RejectError) as info:
        prepare_image(tiny, ImageSpec(image_size=64, min_size=32))
    assert info.value.reason == "image_too_small" and "1x1" in info.value.detail and "32" in info.value.detail
    assert "upscaled" in prepare_image(encode(Image.new("RGB", (40, 40)), "PNG"), ImageSpec(image_size=64,
                                                                                             min_size=32)).notes
    assert ImageSpec.from_config(ImageConfig(min_size=32)).min_size == 32
