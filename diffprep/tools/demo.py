"""Deterministic synthetic demo datasets: coloured shapes with captions that describe them.

Written in the ``directory`` source layout (images/ + captions/; clips:
videos/ + captions/), mixed formats and sizes, so the demo exercises
decoding, cropping, bucketing and batching the way a real folder does.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "stripes")
SIZES = ((96, 96), (128, 96), (96, 128), (80, 80), (160, 112))


def _draw(shape: str, fg: tuple[int, int, int], bg: tuple[int, int, int], size: tuple[int, int]) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(image)
    margin = min(width, height) // 5
    box = (margin, margin, width - margin, height - margin)
    if shape == "circle":
        draw.ellipse(box, fill=fg)
    elif shape == "square":
        draw.rectangle(box, fill=fg)
    elif shape == "triangle":
        draw.polygon([(width // 2, margin), (width - margin, height - margin), (margin, height - margin)], fill=fg)
    else:
        for x in range(0, width, 16):
            draw.rectangle((x, 0, x + 7, height), fill=fg)
    return image


def write_demo_dataset(path: str | Path, samples: int = 24, seed: int = 0) -> Path:
    """Write ``samples`` image/caption pairs under ``path`` (same files for the same arguments)."""
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "captions").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    for i in range(samples):
        shape = SHAPES[i % len(SHAPES)]
        fg_name, bg_name = rng.sample(names, 2)
        size = SIZES[i % len(SIZES)]
        image = _draw(shape, COLOURS[fg_name], COLOURS[bg_name], size)
        stem = f"{i:05d}"
        if i % 3 == 0:
            image.save(root / "images" / f"{stem}.jpg", format="JPEG", quality=92)
        else:
            image.save(root / "images" / f"{stem}.png", format="PNG")
        thing = f"{fg_name} stripes" if shape == "stripes" else f"a {fg_name} {shape}"
        caption = f"{thing} on a {bg_name} background"
        (root / "captions" / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    return root


# (width, height, frames, fps) of the demo clips: two aspect ratios, two lengths, one too short for any bucket.
CLIP_SHAPES = ((64, 48, 9, 8), (48, 64, 9, 8), (64, 48, 13, 12), (64, 64, 9, 8), (64, 48, 3, 8))
MOVES = ("left", "right", "up", "down")


def write_demo_clips(path: str | Path, samples: int = 10, seed: int = 0) -> Path:
    """Write ``samples`` mp4 clips (a shape moving across a background) with captions under ``path``.

    Every fifth clip has 3 frames: shorter than the usual buckets, so the
    demo shows a named ``too_few_frames`` reject. Same files for the same arguments.
    """
    import av

    root = Path(path)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    (root / "captions").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    for i in range(samples):
        width, height, frames, fps = CLIP_SHAPES[i % len(CLIP_SHAPES)]
        shape, move = SHAPES[i % 3], MOVES[i % len(MOVES)]
        fg_name, bg_name = rng.sample(names, 2)
        stem = f"{i:05d}"
        with av.open(str(root / "videos" / f"{stem}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=fps, options={"crf": "18"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for k in range(frames):
                step = (k * 4) % (width // 2)
                image = Image.new("RGB", (width, height), COLOURS[bg_name])
                tile = _draw(shape, COLOURS[fg_name], COLOURS[bg_name], (width // 2, height // 2))
                dx, dy = {"left": (width // 2 - step, height // 4), "right": (step, height // 4),
                          "up": (width // 4, height // 2 - step % (height // 2)),
                          "down": (width // 4, step % (height // 2))}[move]
                image.paste(tile, (dx, dy))
                frame = av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        thing = f"a {fg_name} {shape}"
        caption = f"{thing} moving {move} on a {bg_name} background"
        (root / "captions" / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    return root


def write_av_clip(path: str | Path, *, width: int = 64, height: int = 64, frames: int = 9, fps: int = 24,
                  audio_layout: str | None = "stereo", seconds: float = 1.0, rate: int = 44100, seed: int = 0,
                  broken_audio: bool = False) -> np.ndarray | None:
    """An mp4 clip with sound: ``frames`` frames of H.264 noise at ``fps`` and an AAC track of ``seconds``.

    Each audio channel is a tone of its own (220 Hz, 330 Hz, ...); ``audio_layout``
    None writes no audio stream; ``broken_audio`` keeps the stream but replaces every
    AAC packet's payload with noise (the stream is there and does not decode; the
    video is intact). Returns the samples encoded ``[channels, n]`` (None without audio).
    """
    import av
    from fractions import Fraction

    rng = np.random.default_rng(seed)
    samples = None
    with av.open(str(path), mode="w") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        if audio_layout is not None:
            audio = out.add_stream("aac", rate=rate, layout=audio_layout)
            channels = av.AudioLayout(audio_layout).nb_channels
            time = np.arange(int(seconds * rate), dtype=np.float32) / rate
            samples = np.stack([(0.3 * np.sin(2 * np.pi * (220.0 + 110.0 * c) * time)).astype(np.float32)
                                for c in range(channels)])
            for start in [*range(0, samples.shape[1], 1024), None]:
                frame = None
                if start is not None:
                    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]),
                                                       format="fltp", layout=audio_layout)
                    frame.sample_rate, frame.pts = rate, start
                for packet in audio.encode(frame):
                    if broken_audio:
                        noise = av.Packet(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
                        noise.pts, noise.dts, noise.time_base = packet.pts, packet.dts, packet.time_base
                        noise.stream = audio
                        packet = noise
                    out.mux(packet)
        pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(pixels[index], format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, fps)
            out.mux(video.encode(frame))
        out.mux(video.encode())
    return samples
