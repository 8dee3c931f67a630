"""A posed scene's frames sampled, cropped and resized for storing, its cameras following every step exactly."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PreparedScene:
    pixels: torch.Tensor  # uint8 [N, 3, H, W]: the kept frames as they are stored
    c2w: np.ndarray  # float64 [N, 4, 4]: OpenCV camera-to-world of each stored frame
    K: np.ndarray  # float64 [N, 3, 3]: intrinsics in pixels of the stored frames
    depth: np.ndarray | None  # uint16 [N, d, d] millimetres (depth sources), else None
    meta: dict  # meta.json's scalars (scene_id, num_frames, fps, height, width, ...) and frames[{index, name, original_idx}]
