"""A clip's depth clip (``--depth-column``, Wan: FastGen's VACE ``depth_latent``), prepared as its clip was.

FastGen's VACE network (``fastgen/networks/VaceWan/network.py``, ``prepare_vid_conditioning``) makes its own depth
video from the RGB frames: one depth map per frame, grayscale in [0, 1] replicated to 3 channels
(``vace_depth_annotator.py``), mapped to [-1, 1] and encoded through the same Wan VAE as the clip; a stored
``depth_latent`` takes the place of that encode. So the depth clip here is read frame for frame with its clip:

- the same source frame indices (``meta["frame_indices"]``: the clip's resampling and head/uniform choice), so it
  must have exactly as many frames as the clip's source (``depth_frame_mismatch`` names both counts: another
  count means frame ``i`` of one is not frame ``i`` of the other);
- the same crop and resize (the clip's crop box scaled to the depth clip's size), so it must have the clip's
  aspect ratio to within a pixel (``depth_size_mismatch`` names both sizes); a smaller depth clip is upscaled;
- gray: the mean of its decoded channels, replicated to 3 channels (uint8 ``[F, 3, H, W]``), which the encoding
  maps to [-1, 1] exactly as the clip's pixels. A depth clip that does not decode is ``depth_decode_error``.

An image (a one-frame clip) takes a depth image, by the same size rule.
"""

from __future__ import annotations

from typing import Any

import torch

from diffprep.errors import RejectError
from diffprep.media import video

DEPTH = "depth"  # the ClipSpec.inputs role, the SourceSample.extras key


def depth_frames(clip: Any, name: str, data: bytes, *, max_pixels: int) -> torch.Tensor:
    """The depth clip ``name`` (its bytes ``data``) in ``clip``'s bucket: uint8 ``[F, 3, H, W]``, gray replicated."""
    from diffprep.sources.base import is_image_name

    bucket, (x0, y0, x1, y1) = clip.bucket, clip.meta["crop_box"]
    width, height = clip.meta["original_size"]

    def box(depth_width: int, depth_height: int) -> tuple[float, float, float, float]:
        if abs(depth_width * height / width - depth_height) > 1:
            raise RejectError("depth_size_mismatch", f"the depth clip {name} is {depth_width}x{depth_height}, its "
                              f"clip {width}x{height}: a depth clip needs the clip's aspect ratio")
        sx, sy = depth_width / width, depth_height / height
        return (x0 * sx, y0 * sy, x1 * sx, y1 * sy)

    try:
        if clip.info is None:  # an image sample: a depth image
            if not is_image_name(name):
                raise RejectError("depth_frame_mismatch", f"the depth {name} is not an image, its sample a "
                                  "single image: give a depth image (png, jpg) of the same size")
            frame = _image_frame(data, bucket, box, max_pixels)
            frames = frame[None].expand(bucket.frames, -1, -1, -1)
        else:
            with video._open(data) as container:
                info = video._index(container, max_pixels=max_pixels)
                if info.frames != clip.info.frames:
                    raise RejectError("depth_frame_mismatch", f"the depth clip {name} has {info.frames} frames, its "
                                      f"clip {clip.info.frames}: a depth clip needs one frame per frame of its clip")
                frames = video._decode_frames(container, info, list(clip.meta["frame_indices"]), bucket,
                                              box(info.width, info.height))
    except RejectError as error:
        if error.reason in ("depth_size_mismatch", "depth_frame_mismatch"):
            raise
        raise RejectError("depth_decode_error", f"the depth clip {name}: {error.detail}") from None
    except Exception as error:  # noqa: BLE001 - any depth clip that does not decode is this sample's reject
        raise RejectError("depth_decode_error", f"the depth clip {name}: {type(error).__name__}: {error}") from None
    gray = frames.float().mean(dim=1, keepdim=True).round().to(torch.uint8)
    return gray.expand(-1, 3, -1, -1).contiguous()


def _image_frame(data: bytes, bucket: Any, box: Any, max_pixels: int) -> torch.Tensor:
    from diffprep.media import images

    spec = images.ImageSpec(max_pixels=max_pixels)
    with images._open(data, spec) as img:
        images._load(img, [])
        images._exif_transpose(img, [])
        rgb = images._to_rgb(img, spec.background, [])
        return torch.from_numpy(video._resize(rgb, bucket, box(*rgb.size)).copy()).permute(2, 0, 1)


__all__ = ["DEPTH", "depth_frames"]
