"""Captions per second: diffprep's captioner against a plain transformers loop over the same samples, in one run.

The plain loop is what transformers' model card for Qwen2.5-VL shows: one sample at a time,
``Qwen2_5_VLProcessor(text=..., images=... / videos=...)`` then ``model.generate`` (greedy) and
``batch_decode``. diffprep's side is :class:`diffprep.captions.models.TransformersCaptioner` in batches of
``--batch-size`` (left padding). Both use the same loaded model and the same decoded inputs (frames sampled by
``diffprep.captions.frames``), so the ratio is the batching's alone; rounds alternate (A B B A), each side the
fastest of its rounds. It also counts the samples whose captions differ between the two (greedy: there should be
none where the processor's arithmetic is the same; clips through transformers' video processor need torchvision,
whose bicubic filter is not Pillow's, so they may differ there).

Without torchvision (this project's CPU machines), the processor is built from its parts with its class check
bypassed (the check looks up the torchvision-only video base class) and the plain loop takes the images only.

    python benchmarks/captions.py                                      # tiny random-weight model, CPU, 24 samples
    python benchmarks/captions.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda --samples 256 \\
        --batch-size 16 --max-new-tokens 512 --clips 0.5                # the GPU figures (README)
"""

from __future__ import annotations

import _env  # first: offline environment

# isort: split

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import _common as c
from diffprep.captions.frames import caption_input
from diffprep.captions.models import CaptionSettings, TransformersCaptioner


def samples(count: int, clips: float, seed: int, image_size: int, clip_seconds: float, fps: float,
            max_frames: int) -> list:
    """``count`` inputs, a ``clips`` fraction of them clips, decoded as the caption flow decodes them."""
    from diffprep.media.mp4 import mp4_bytes

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        w, h = (int(image_size * s) // 2 * 2 for s in rng.uniform(0.5, 1.0, 2))
        base = rng.integers(0, 256, (h, w * 2, 3), dtype=np.uint8)
        if i < round(count * clips):
            frames = max(2, int(clip_seconds * 8))
            pixels = np.stack([base[:, k * w // frames: k * w // frames + w] for k in range(frames)])
            data = mp4_bytes(torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), 8.0)
        else:
            buffer = io.BytesIO()
            Image.fromarray(base[:, :w]).save(buffer, format="PNG")
            data = buffer.getvalue()
        out.append(caption_input(f"s{i}", data, fps=fps, max_frames=max_frames))
    return out


def plain_processor(folder: Path):
    """transformers' own processor for the model: AutoProcessor, or (no torchvision) the class from its parts."""
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(folder), True
    except (ImportError, AttributeError, ValueError, OSError):
        from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil
        from transformers.processing_utils import ProcessorMixin

        ProcessorMixin.check_argument_for_proper_class = lambda self, name, argument: None
        template = folder / "chat_template.jinja"
        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder, padding_side="left"), video_processor=None,
            chat_template=template.read_text(encoding="utf-8") if template.is_file() else None), False


def plain_loop(processor, model, items, instruction: str, max_new_tokens: int, device: str) -> list[str]:
    captions = []
    for item in items:
        kind = "video" if item.is_video else "image"
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": instruction}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if item.is_video:
            video = np.stack([np.asarray(frame) for frame in item.frames])
            inputs = processor(text=[text], videos=[video], padding=True, return_tensors="pt",
                               videos_kwargs={"fps": item.fps, "do_sample_frames": False,
                                              "cap_pixels_per_frame": True})
        else:
            inputs = processor(text=[text], images=item.frames, padding=True, return_tensors="pt")
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
        for name in ("pixel_values", "pixel_values_videos"):
            if name in inputs:
                inputs[name] = inputs[name].to(model.dtype)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        new = out[:, inputs["input_ids"].shape[1]:]
        captions.append(processor.batch_decode(new, skip_special_tokens=True)[0].strip())
    return captions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--model", default=None, help="hub id or folder (default: the tiny random-weight model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--clips", type=float, default=0.25, help="fraction of the samples that are clips")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--image-size", type=int, default=128, help="longest side of the generated samples")
    parser.add_argument("--clip-seconds", type=float, default=2.0)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--max-frames", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    cache = c.cache_dir(args.cache_dir)
    if args.model is None:
        from diffprep.captions.tiny import write_tiny_qwen2_5_vl

        folder = cache / "tiny-qwen2.5-vl"
        if not (folder / "config.json").is_file():
            write_tiny_qwen2_5_vl(folder)
        args.model = str(folder)
    print(c.describe_machine())
    settings = CaptionSettings(model=args.model, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                               fps=args.fps, max_frames=args.max_frames)
    started = time.perf_counter()
    captioner = TransformersCaptioner(settings, device=args.device)
    print(f"model {args.model} loaded in {time.perf_counter() - started:.1f} s ({captioner.model.dtype})")
    processor, has_video = plain_processor(captioner.part.path)
    items = samples(args.samples, args.clips if has_video else 0.0, 0, args.image_size, args.clip_seconds,
                    args.fps, args.max_frames)
    clips = sum(item.is_video for item in items)
    print(f"{len(items)} samples ({clips} clips{'' if has_video else ': no torchvision, so images only'}), "
          f"batch {args.batch_size}, {args.max_new_tokens} new tokens at most")

    def ours() -> list[str]:
        return [text for s in range(0, len(items), args.batch_size)
                for text in captioner.caption(items[s:s + args.batch_size])]

    def plain() -> list[str]:
        return plain_loop(processor, captioner.model, items, settings.instruction, args.max_new_tokens, args.device)

    times: dict[str, list[float]] = {"diffprep": [], "plain": []}
    results: dict[str, list[str]] = {}
    order = [("diffprep", ours), ("plain", plain), ("plain", plain), ("diffprep", ours)] * args.rounds
    for name, run in order[: 2 * args.rounds]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results[name] = run()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times[name].append(time.perf_counter() - t0)
    rate = {name: len(items) / c.best(values) for name, values in times.items()}
    differ = [item.key for item, a, b in zip(items, results["diffprep"], results["plain"]) if a != b]
    print(f"diffprep: {rate['diffprep']:.2f} captions/s; plain transformers loop: {rate['plain']:.2f} captions/s; "
          f"ratio {rate['diffprep'] / rate['plain']:.2f}x")
    print(f"captions that differ between the two: {len(differ)} of {len(items)} "
          f"({sum(k in differ for k in (i.key for i in items if i.is_video))} clips) {differ[:8]}")
    if args.device.startswith("cuda"):
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": rate, "times": times, "differ": differ, "samples": len(items),
                                               "clips": clips, "args": vars(args)}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
