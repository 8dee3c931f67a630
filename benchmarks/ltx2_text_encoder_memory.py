"""LTX-2 text encoder: memory of --load-text-encoder-in-8bit against the bf16 load, on the CPU.

A random-weight Gemma 3 at the real 12B width (hidden 3840, MLP 15360, 16/8
heads of 256) but only ``--layers`` text layers and a 32k vocabulary is written
once, then loaded in a fresh process each way through ``ltx2_gemma.load_gemma`` and
one caption encoded. Printed per mode: the process's peak RSS, its RSS after
the encode (all of it, then after malloc_trim split into anonymous memory and
mapped file pages), the model's
footprint (``get_memory_footprint``) and the encode time. The last lines scale
the footprint to Gemma 3 12B's real parameter counts (counted on the meta
device from ltx-core's GEMMA3_CONFIG_FOR_LTX), Linear layers but lm_head in
int8, the rest in bf16: that is a computed figure, not a measured one.

    python benchmarks/ltx2_text_encoder_memory.py [--layers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from diffprep.families.ltx2_tiny import _gemma_tokenizer

    tokenizer = _gemma_tokenizer()
    config = Gemma3Config(
        text_config={
            "vocab_size": 32768,
            "hidden_size": 3840,
            "intermediate_size": 15360,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        vision_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
            "image_size": 28, "patch_size": 14, "vision_use_head": False,
        },
        mm_tokens_per_image=4,
        boi_token_index=32765,
        eoi_token_index=32766,
        image_token_index=32767,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def measure(folder: Path, mode: str) -> dict:
    import torch

    from diffprep.families import ltx2_gemma

    start = time.perf_counter()
    encoder = ltx2_gemma.load_gemma(folder, device=torch.device("cpu"), load_in_8bit=(mode == "int8"))
    loaded = time.perf_counter()
    with torch.no_grad():
        states, mask = encoder.encode("a cat walking on the road at night")
    done = time.perf_counter()
    import ctypes
    import gc

    import psutil

    rss_after = psutil.Process().memory_info().rss / 2**20
    # What the allocator keeps of freed load-time buffers is not the model's: give it back, then measure again.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {
        "mode": mode,
        "rss_after_mib": rss_after,
        "rss_trimmed_mib": psutil.Process().memory_info().rss / 2**20,
        # RSS counts the safetensors file's mapped pages too (page cache, reclaimable); RssAnon is what the
        # process itself holds.
        "rss_anon_mib": _status_kib("RssAnon") / 1024,
        "rss_file_mib": _status_kib("RssFile") / 1024,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "footprint_mib": encoder.model.get_memory_footprint() / 2**20,
        "load_s": loaded - start,
        "encode_s": done - loaded,
        "layers": len(states),
    }


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def gemma_12b_estimate() -> dict:
    import torch
    from ltx_core.text_encoders.gemma import GemmaTextEncoderConfigurator

    model = GemmaTextEncoderConfigurator.from_config({}).model  # Gemma 3 12B on the meta device
    quantized = other = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            quantized += module.weight.numel()
            # int8 weight + one fp32 scale per output row; the bias stays bf16
            other += module.out_features * 2 + (module.bias.numel() if module.bias is not None else 0)
    total = sum(p.numel() for p in model.parameters())
    lm_head = model.lm_head.weight.numel()  # tied to embed_tokens: one copy in memory
    bf16 = (total - lm_head) * 2
    int8 = quantized + (total - lm_head - quantized) * 2 + other * 2
    return {"params_b": (total - lm_head) / 1e9, "bf16_gib": bf16 / 2**30, "int8_gib": int8 / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="write (or reuse) the model here instead of a temporary folder")
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), args.child[1])))
        return

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch) / "gemma"
        if not (folder / "config.json").exists():
            write_model(folder, args.layers)
        results = {}
        for mode in ("bf16", "int8"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(folder), mode], check=True, capture_output=True, text=True
            ).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
            r = results[mode]
            print(
                f"{mode}: peak RSS {r['peak_rss_mib']:.0f} MiB, RSS after encode {r['rss_after_mib']:.0f} MiB "
                f"({r['rss_trimmed_mib']:.0f} after malloc_trim: anonymous {r['rss_anon_mib']:.0f}, "
                f"mapped files {r['rss_file_mib']:.0f}), footprint {r['footprint_mib']:.0f} MiB, "
                f"load {r['load_s']:.1f} s, encode {r['encode_s']:.2f} s"
            )
    estimate = gemma_12b_estimate()
    print(
        f"Gemma 3 12B ({estimate['params_b']:.2f} B parameters, computed): "
        f"bf16 {estimate['bf16_gib']:.1f} GiB, int8 {estimate['int8_gib']:.1f} GiB"
    )
    b, q = results["bf16"], results["int8"]
    print(
        f"SUMMARY ltx2_text_encoder_memory layers={args.layers} "
        f"footprint_int8/bf16={q['footprint_mib'] / b['footprint_mib']:.3f} "
        f"peak_rss_int8/bf16={q['peak_rss_mib'] / b['peak_rss_mib']:.3f} "
        f"rss_after_int8/bf16={q['rss_after_mib'] / b['rss_after_mib']:.3f} "
        f"rss_trimmed_int8/bf16={q['rss_trimmed_mib'] / b['rss_trimmed_mib']:.3f} "
        f"rss_anon_int8/bf16={q['rss_anon_mib'] / b['rss_anon_mib']:.3f} "
        f"gemma12b_int8/bf16={estimate['int8_gib'] / estimate['bf16_gib']:.3f}"
    )


if __name__ == "__main__":
    main()
