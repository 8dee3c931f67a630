"""Decode work per window of a long video: frames decoded with the seek against from the start, per unit.

A long synthetic source (a hard cut every 100 frames, a key frame every 30) is cut as a `--split-scenes
content --clip-mode chain` run cuts it; every window is decoded alone (diffprep.media.window_decode) and the
frames the decoder returned are counted. Reference: the same windows decoded from the start (what a decoder
without seeking does: last frame + 1 per window). Prints both totals, their ratio, and the worst window's
decoded frames against its own length.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffprep.media.buckets import Bucket  # noqa: E402
from diffprep.media.video import probe  # noqa: E402
from diffprep.media.window_decode import decode_window, timeline  # noqa: E402
from diffprep.media.windows import SceneSettings, shot_spans, source_windows  # noqa: E402

FRAMES, SHOT, GOP = 3000, 100, 30
BUCKETS = [Bucket(64, 48, 25)]


def long_clip() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=25, options={"g": str(GOP), "sc_threshold": "0", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(FRAMES):
            pixels = np.full((48, 64, 3), (i // SHOT * 53) % 256, np.uint8)
            pixels[:8, i % 56:i % 56 + 8] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def main() -> None:
    data = long_clip()
    info = probe(data)
    shots = [(s, min(s + SHOT, FRAMES) - 1) for s in range(0, FRAMES, SHOT)]  # the cuts the detector finds
    windows, _ = source_windows(info.width, info.height, shot_spans(shots, timeline(info, None)), BUCKETS,
                                SceneSettings(clip_mode="chain"))
    started = time.perf_counter()
    decoded, worst = 0, 0.0
    for window in windows:
        work: dict[str, int] = {}
        decode_window(data, window.bucket, window.first, window.last, target_fps=None, work=work)
        decoded += work["decoded"]
        worst = max(worst, work["decoded"] / window.frames)
    seconds = time.perf_counter() - started
    from_start = sum(window.last + 1 for window in windows)
    print(f"{len(windows)} windows of {BUCKETS[0].frames} frames in a {FRAMES}-frame source ({seconds:.1f} s)")
    print(f"decoded with seeking: {decoded} frames; from the start per window: {from_start} frames")
    print(f"SUMMARY seek/from-start decoded frames = {decoded / from_start:.3f}; worst window decodes "
          f"{worst:.2f}x its own frames")


if __name__ == "__main__":
    main()
