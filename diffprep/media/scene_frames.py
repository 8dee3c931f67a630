"""A posed scene's frames sampled, cropped and resized for storing, its cameras following every step exactly.

``SceneSpec.prepare(scene)``:

1. **Frames kept**: a scene with fewer frames than ``scenes.frames`` is the reject ``too_few_frames`` (the count
   and the flag); else ``media/scene_sampling.py`` picks them (head | uniform | progressive; every frame when
   ``scenes.frames`` is unset) and, for a chunk (``Scene.chunk``), its range of the kept frames.
2. **Pixels**: each kept frame image read (``images.decode_rgb``: any mode Pillow reads to RGB, 16-bit to 8 by the
   high byte; EXIF orientation *not* applied -- the camera describes the pixels as stored); a missing file is
   ``missing_frame``, frames of different sizes in one scene ``frame_size_mismatch``.
3. **Size** (``scenes.resolution`` S): GAE's centre square crop -- ``side = min(H, W)``, ``x0 = (W - side) // 2``,
   ``y0 = (H - side) // 2`` -- then a resize to S x S with Pillow's BOX filter (an area average, Pillow's
   counterpart of the ``cv2.INTER_AREA`` GAE uses; it repeats pixels when enlarging). K: ``cx -= x0``,
   ``cy -= y0``, then fx, fy, cx, cy times ``S / side`` (``cameras.crop_resize``; exact in the pixel-corner
   convention Pillow's resize uses). Unset: the frames' own size, K unchanged.
4. **Depth** (depth sources): each frame's uint16 PNG (millimetres; another bit depth or an unreadable file is
   ``depth_unreadable``, an aspect ratio other than the frames' ``depth_size_mismatch``), the same centre square
   of its own size, then nearest to ``scenes.depth_resolution`` square: stored pixel ``i`` takes source pixel
   ``x0 + floor((i + 0.5) * side / d)``, the one under its centre (cv2's INTER_NEAREST, which GAE uses, takes
   ``floor(i * side / d)``, half a source pixel up and left). Without ``scenes.resolution`` the maps keep their
   own size.

``meta`` holds every scalar meta.json needs -- scene_id, num_frames, fps, height, width, rgb_resolution, source,
caption, split, sampling_mode, requested_frames, source_frames, source_width/height, crop_box, depth_resolution
(depth sources), chunk_index/total_chunks/start_frame/end_frame (chunks), the format's info (applied_gl2cv,
pose_key, url...) -- then ``frames: [{index, name, original_idx}]`` (chunks add frame_idx and global_frame_idx:
the frame's position in the chunk and among the scene's kept frames).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from diffprep.errors import ConfigError, RejectError
from diffprep.media.images import ImageSpec, decode_rgb
from diffprep.sources.scenes.cameras import crop_resize
from diffprep.sources.scenes.sampling import SAMPLINGS, chunk_name, chunk_ranges, kept_indices
from diffprep.sources.scenes.base import Scene, SceneFrame

DEPTH_MODES = frozenset({"I;16", "I;16B", "I;16L"})


@dataclass
class PreparedScene:
    pixels: torch.Tensor  # uint8 [N, 3, H, W]: the kept frames as they are stored
    c2w: np.ndarray  # float64 [N, 4, 4]: OpenCV camera-to-world of each stored frame
    K: np.ndarray  # float64 [N, 3, 3]: intrinsics in pixels of the stored frames
    depth: np.ndarray | None  # uint16 [N, d, d] millimetres (depth sources), else None
    meta: dict  # meta.json's scalars (scene_id, num_frames, fps, height, width, ...), then frames[{index, name, ...}]


@dataclass(frozen=True)
class SceneSpec:
    """How a scene becomes stored frames (the settings' ``scenes`` section and ``video.frame_sampling``)."""

    frames: int | None = None  # frames kept per scene; None: every frame
    sampling: str = "uniform"  # head | uniform | progressive
    resolution: int | None = None  # centre square crop + resize to this side; None: own size
    depth_resolution: int = 192
    fps: float = 15.0
    chunk_frames: int | None = 400  # chunks of the kept frames (a tail under half joins the last); None: never cut
    max_pixels: int = 89_478_485  # a frame image above this many pixels is image_too_large (decompression bombs)

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"video.frame_sampling for scenes must be one of {', '.join(SAMPLINGS)}, "
                              f"got {self.sampling!r}")
        for name, low in (("frames", 1), ("resolution", 2), ("chunk_frames", 2)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"scenes.{name} must be at least {low}, got {value}")

    @classmethod
    def from_settings(cls, settings: Any) -> SceneSpec:
        scenes = settings.scenes
        return cls(frames=scenes.frames, sampling=settings.video.frame_sampling, resolution=scenes.resolution,
                   depth_resolution=scenes.depth_resolution, fps=float(scenes.fps), chunk_frames=scenes.chunk_frames,
                   max_pixels=settings.image.max_pixels)

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (plan.json; ``from_description`` reads them back)."""
        return asdict(self)

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> SceneSpec:
        return cls(**{name: description[name] for name in cls.__dataclass_fields__ if name in description})

    def prepare(self, scene: Scene) -> PreparedScene:
        frames, chunk = self._select(scene)
        images, size = _read_frames(frames, self.max_pixels)
        width, height = size
        if self.resolution is None:
            box, pixels = (0, 0, width, height), [np.asarray(img) for img in images]
            K = np.stack([frame.K for frame in frames])
        else:
            side = min(width, height)
            x0, y0 = (width - side) // 2, (height - side) // 2
            box = (x0, y0, x0 + side, y0 + side)
            pixels = [np.asarray(img.crop(box) if side == self.resolution else
                                 img.resize((self.resolution, self.resolution), Image.Resampling.BOX, box=box))
                      for img in images]
            K = np.stack([crop_resize(frame.K, x0, y0, side, self.resolution) for frame in frames])
        for img in images:
            img.close()
        stored = torch.from_numpy(np.ascontiguousarray(np.stack(pixels).transpose(0, 3, 1, 2)))
        depth = self._depth(frames, size)
        out_h, out_w = int(stored.shape[2]), int(stored.shape[3])
        meta: dict[str, Any] = {
            "scene_id": scene.scene_id, "num_frames": len(frames), "fps": self.fps, "height": out_h, "width": out_w,
            "rgb_resolution": min(out_h, out_w), "source": scene.source, "caption": scene.caption or "",
        }
        if scene.split is not None:
            meta["split"] = scene.split
        meta.update({"sampling_mode": self.sampling, "requested_frames": self.frames,
                     "source_frames": len(scene.frames), "source_width": width, "source_height": height,
                     "crop_box": list(box)})
        if depth is not None:
            meta["depth_resolution"] = int(depth.shape[1]) if self.resolution is not None else None
        entries = [{"index": i, "name": frame.name, "original_idx": frame.original_idx}
                   for i, frame in enumerate(frames)]
        if chunk is not None:
            meta.update(chunk)
            for i, entry in enumerate(entries):
                entry.update(frame_idx=i, global_frame_idx=chunk["start_frame"] + i)
        meta.update({key: value for key, value in scene.info.items() if key not in meta})
        meta["frames"] = entries
        return PreparedScene(pixels=stored, c2w=np.stack([frame.c2w for frame in frames]), K=K, depth=depth,
                             meta=meta)

    def _select(self, scene: Scene) -> tuple[list[SceneFrame], dict[str, Any] | None]:
        total = len(scene.frames)
        if self.frames is not None and total < self.frames:
            raise RejectError("too_few_frames", f"the scene has {total} frames, fewer than the {self.frames} "
                              f"--scene-frames asks for: lower --scene-frames (to {total} or less) or unset it to "
                              "keep every frame", phase="decode")
        kept = kept_indices([frame.c2w for frame in scene.frames], self.frames, self.sampling)
        ranges = chunk_ranges(len(kept), self.chunk_frames)
        if scene.chunk is None and len(ranges) == 1:
            return [scene.frames[i] for i in kept], None
        if scene.chunk is None or scene.chunk >= len(ranges):
            planned = "the whole scene" if scene.chunk is None else chunk_name(scene.chunk)
            raise RejectError("scene_changed", f"{len(kept)} kept frames make {len(ranges)} chunk(s) of "
                              f"{self.chunk_frames}; the plan has {planned}: plan the run again", phase="decode")
        start, end = ranges[scene.chunk]
        chunk = {"chunk_index": scene.chunk, "total_chunks": len(ranges), "start_frame": start, "end_frame": end}
        return [scene.frames[i] for i in kept[start:end]], chunk

    def _depth(self, frames: list[SceneFrame], size: tuple[int, int]) -> np.ndarray | None:
        if all(frame.depth is None for frame in frames):
            return None
        maps = [_read_depth(frame) for frame in frames]
        shapes = {m.shape for m in maps}
        if len(shapes) > 1:
            raise RejectError("depth_size_mismatch", f"the depth maps have different sizes: "
                              f"{sorted(f'{w}x{h}' for h, w in shapes)}", phase="decode")
        (dh, dw), (width, height) = maps[0].shape, size
        if abs(dw * height - dh * width) > max(width, height):
            raise RejectError("depth_size_mismatch", f"the depth maps are {dw}x{dh}, the frames {width}x{height}: "
                              "not the same aspect ratio, so no crop fits both", phase="decode")
        if self.resolution is None:
            return np.stack(maps)
        side, d = min(dh, dw), self.depth_resolution
        x0, y0 = (dw - side) // 2, (dh - side) // 2
        index = (2 * np.arange(d) + 1) * side // (2 * d)
        return np.stack([m[np.ix_(y0 + index, x0 + index)] for m in maps])


def _read_frames(frames: list[SceneFrame], max_pixels: int) -> tuple[list[Image.Image], tuple[int, int]]:
    spec = ImageSpec(max_pixels=max_pixels)
    images: list[Image.Image] = []
    try:
        for frame in frames:
            try:
                with open(frame.image, "rb") as handle:
                    data = handle.read()
            except FileNotFoundError:
                raise RejectError("missing_frame", f"frame {frame.name}: its image {frame.image} does not exist",
                                  phase="decode") from None
            try:
                image, _ = decode_rgb(data, spec, exif_transpose=False)
            except RejectError as error:
                raise RejectError(error.reason, f"frame {frame.name}: {error.detail}", phase="decode") from None
            images.append(image)
            if image.size != images[0].size:
                first = frames[0]
                raise RejectError("frame_size_mismatch", f"frame {frame.name} is {image.width}x{image.height}, "
                                  f"frame {first.name} {images[0].width}x{images[0].height}: a scene's frames must "
                                  "all have one size", phase="decode")
    except BaseException:
        for image in images:
            image.close()
        raise
    return images, images[0].size


def _read_depth(frame: SceneFrame) -> np.ndarray:
    if frame.depth is None:
        raise RejectError("depth_unreadable", f"frame {frame.name} has no depth map where the others have one",
                          phase="decode")
    try:
        with Image.open(frame.depth) as img:
            img.load()
            mode, values = img.mode, np.asarray(img)
    except FileNotFoundError:
        raise RejectError("depth_unreadable", f"frame {frame.name}: its depth map {frame.depth} does not exist",
                          phase="decode") from None
    except Exception as error:  # noqa: BLE001 - Pillow raises many types on a broken file: the named reject
        raise RejectError("depth_unreadable", f"frame {frame.name}: the depth map does not read: "
                          f"{type(error).__name__}: {error}", phase="decode") from None
    if mode not in DEPTH_MODES and not (mode == "I" and values.size and 0 <= values.min() and values.max() < 65536):
        raise RejectError("depth_unreadable", f"frame {frame.name}: the depth map is Pillow mode {mode}, not a "
                          "16-bit single-channel PNG (uint16 millimetres)", phase="decode")
    return values.astype(np.uint16)
