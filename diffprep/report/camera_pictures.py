"""A scene's cameras drawn as a person checks them: the path and a frustum per frame, seen from above and the side.

``camera_views(c2w, intrinsics, width, height)`` gives a uint8 ``[3, H, 2H]``
picture: on the left the top view (world x to the right, z up the page), on the
right the side view (z to the right, -y up: OpenCV's y points down). Each frame's
camera centre is a dot on the path, coloured from blue (first) to red (last); its
frustum is the four image corners back-projected through K to a depth of a tenth of
the path's extent, joined to the centre, with the first frame's in green. A flipped
axis shows at a glance: the frustums point away from the path, or upside down in
the side view. ``diffprep decode`` writes it above the scene's frames, laid out in a grid of bounded size
(``with_frames``).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw

PANEL = 256
MARGIN = 16


def frustum_points(c2w: np.ndarray, rows: np.ndarray, width: int, height: int, depth: float) -> np.ndarray:
    """World points ``[N, 5, 3]``: each camera's centre and its image corners back-projected to ``depth``."""
    corners = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float64)
    result = []
    for pose, (fx, fy, cx, cy) in zip(np.asarray(c2w, np.float64), np.asarray(rows, np.float64)):
        rays = np.stack([(corners[:, 0] - cx) / fx, (corners[:, 1] - cy) / fy, np.ones(4)], axis=1) * depth
        world = rays @ pose[:3, :3].T + pose[:3, 3]
        result.append(np.vstack([pose[:3, 3], world]))
    return np.asarray(result)


def _panel(points: np.ndarray, axes: tuple[int, int], signs: tuple[float, float], label: str) -> Image.Image:
    image = Image.new("RGB", (PANEL, PANEL), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    flat = np.stack([points[..., axes[0]] * signs[0], points[..., axes[1]] * signs[1]], axis=-1)  # [N, 5, 2]
    low, high = flat.reshape(-1, 2).min(axis=0), flat.reshape(-1, 2).max(axis=0)
    scale = (PANEL - 2 * MARGIN) / max(float((high - low).max()), 1e-9)
    centre = (low + high) / 2

    def pixel(p: np.ndarray) -> tuple[float, float]:
        x, y = (p - centre) * scale
        return PANEL / 2 + x, PANEL / 2 - y  # up the page is +

    count = len(flat)
    for i, cam in enumerate(flat):
        t = i / max(1, count - 1)
        colour = (40, 170, 60) if i == 0 else (int(255 * t), 60, int(255 * (1 - t)))
        centre_px = pixel(cam[0])
        for corner in cam[1:]:
            draw.line([centre_px, pixel(corner)], fill=colour, width=1)
        draw.line([pixel(c) for c in cam[1:]] + [pixel(cam[1])], fill=colour, width=1)
        if i:
            draw.line([pixel(flat[i - 1][0]), centre_px], fill=(90, 90, 90), width=1)
        draw.ellipse([centre_px[0] - 2, centre_px[1] - 2, centre_px[0] + 2, centre_px[1] + 2], fill=colour)
    draw.text((4, 2), label, fill=(0, 0, 0))
    return image


def camera_views(c2w: np.ndarray, intrinsics: np.ndarray, width: int, height: int) -> torch.Tensor:
    """uint8 ``[3, PANEL, 2 * PANEL]``: the top and the side view of the cameras (module docstring)."""
    centres = np.asarray(c2w, np.float64)[:, :3, 3]
    extent = float(np.ptp(centres, axis=0).max()) if len(centres) > 1 else 0.0
    points = frustum_points(c2w, intrinsics, width, height, 0.1 * extent if extent > 0 else 1.0)
    views = [_panel(points, (0, 2), (1, 1), "top: x ->, z ^"), _panel(points, (2, 1), (1, -1), "side: z ->, -y ^")]
    picture = Image.new("RGB", (2 * PANEL, PANEL))
    for i, view in enumerate(views):
        picture.paste(view, (i * PANEL, 0))
    return torch.from_numpy(np.array(picture)).permute(2, 0, 1).contiguous()


def with_frames(views: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """uint8 ``[3, H, W]``: the camera views above the frames' grid (``diffprep.report.pictures.frame_grid``), left-aligned
    on a light background; as wide as the wider of the two, so as bounded as the grid."""
    width = max(int(views.shape[2]), int(grid.shape[2]))
    picture = torch.full((3, int(views.shape[1]) + int(grid.shape[1]), width), 250, dtype=torch.uint8)
    picture[:, : views.shape[1], : views.shape[2]] = views
    picture[:, views.shape[1]:, : grid.shape[2]] = grid
    return picture


__all__ = ["camera_views", "frustum_points", "with_frames"]
