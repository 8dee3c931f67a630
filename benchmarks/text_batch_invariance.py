"""Does a caption's text embedding depend on the batch it is encoded in? Bit for bit, on this machine.

Why ``diffprep`` encodes captions in batches of exactly ``TEXT_BATCH`` (``diffprep/families/text_cache.py``):
a cached caption must have the bytes it would have had in any other batch. This script encodes the same
captions alone, in batches of 2, 3, 4 and N, in a shuffled batch of N and each one in a batch of N filled with
empty captions, through the text encoders' forward passes as diffprep runs them (T5 padded to max_length,
no mask; CLIP at 77 tokens, ``pooler_output``; Wan's UMT5 with its mask, zero past the true length), and
prints which ways of batching agree bit for bit. Random weights, nothing downloaded.

    python benchmarks/text_batch_invariance.py                              # Flux, medium widths, fp32
    python benchmarks/text_batch_invariance.py --threads 8 --width real     # CLIP-L / T5-XXL widths, 1-2 layers
    python benchmarks/text_batch_invariance.py --family wan --precision bf16 --device cuda --layers 0
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


# isort: split

import _common as c
import torch

from diffprep.families.base import DTYPES
from diffprep.families.wan import clean_caption

WORDS = ("a photo of the cat dog bird horse red blue green small large sitting on in with water sky city house "
         "tree flower mountain river painting detailed").split()
# (CLIP, T5 or UMT5) widths; "real" is CLIP-L and T5-XXL (UMT5-XXL), their layer counts cut by --layers.
WIDTHS = {
    "medium": ({**c.MEDIUM_CLIP}, {**c.MEDIUM_T5}),
    "real": ({"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "projection_dim": 768,
              "num_hidden_layers": 12},
             {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64, "num_layers": 24}),
}


def captions(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def partitions(n: int) -> list[tuple[str, list[list[int]]]]:
    """Ways to batch captions 0..n-1; -1 stands for an empty caption filling a batch."""
    idx = list(range(n))
    shuffled = idx[:]
    random.Random(1).shuffle(shuffled)
    ways = [("alone", [[i] for i in idx])]
    ways += [(f"B={b}", [idx[s:s + b] for s in range(0, n, b)]) for b in sorted({2, 3, 4, n}) if b <= n]
    ways.append((f"B={n} shuffled", [shuffled]))
    ways.append((f"B={n} filled", [[-1] * (i % n) + [i] + [-1] * (n - 1 - i % n) for i in idx]))
    return ways


def encoders(args: argparse.Namespace, cache: Path, dtype: torch.dtype, device: torch.device):
    """An ``encode(list of captions) -> list of output tensors [B, ...]`` function and the names of its outputs."""
    if args.family == "flux":
        tiny = c.tiny_model(cache)
        clip_tok, t5_tok = c.load_tokenizers(tiny)
        if args.width == "tiny":
            from transformers import CLIPTextModel, T5EncoderModel

            clip, t5 = (CLIPTextModel.from_pretrained(tiny / "text_encoder"),
                        T5EncoderModel.from_pretrained(tiny / "text_encoder_2"))
        else:
            clip_cfg, t5_cfg = WIDTHS[args.width]
            if args.layers:
                clip_cfg, t5_cfg = {**clip_cfg, "num_hidden_layers": args.layers}, {**t5_cfg, "num_layers": args.layers}
            torch.manual_seed(0)
            clip, t5 = c.build_clip(clip_tok, **clip_cfg), c.build_t5(t5_tok, **t5_cfg)
        clip, t5 = (m.eval().requires_grad_(False).to(device, dtype) for m in (clip, t5))

        def encode(texts: list[str]) -> list[torch.Tensor]:
            t5_ids = t5_tok(texts, padding="max_length", max_length=args.max_length, truncation=True,
                            return_tensors="pt").input_ids
            clip_ids = clip_tok(texts, padding="max_length", max_length=77, truncation=True,
                                return_tensors="pt").input_ids
            return [t5(t5_ids.to(device))[0].cpu(), clip(clip_ids.to(device)).pooler_output.cpu()]

        return encode, ["T5", "CLIP"]

    from diffprep.families.wan_tiny import write_tiny_wan
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    tiny = cache / "tiny-wan"
    if not (tiny / "model_index.json").is_file():
        write_tiny_wan(tiny)
    tok = AutoTokenizer.from_pretrained(tiny / "tokenizer")
    if args.width == "tiny":
        model = UMT5EncoderModel.from_pretrained(tiny / "text_encoder")
    else:
        cfg = {**WIDTHS[args.width][1], **({"num_layers": args.layers} if args.layers else {})}
        torch.manual_seed(0)
        model = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), feed_forward_proj="gated-gelu",
                                            is_encoder_decoder=False, use_cache=False, pad_token_id=tok.pad_token_id,
                                            eos_token_id=tok.eos_token_id, **cfg))
    model = model.eval().requires_grad_(False).to(device, dtype)

    def encode(texts: list[str]) -> list[torch.Tensor]:
        inputs = tok([clean_caption(t) for t in texts], padding="max_length", max_length=args.max_length,
                     truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        hidden = model(inputs.input_ids.to(device), inputs.attention_mask.to(device)).last_hidden_state.cpu()
        past = torch.arange(args.max_length)[None, :] >= inputs.attention_mask.sum(dim=1)[:, None]
        return [hidden.masked_fill(past[:, :, None], 0.0)]

    return encode, ["UMT5"]


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_flags(parser)
    parser.add_argument("--family", choices=["flux", "wan"], default="flux")
    parser.add_argument("--width", choices=["tiny", "medium", "real"], default="medium")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of each text encoder (default: the width's own; 'real' on a CPU: try 1 or 2)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--captions", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512, help="T5/UMT5 tokens (default 512)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.precision]
    encode, names = encoders(args, c.cache_dir(args.cache_dir), dtype, device)
    texts = captions(args.captions)
    print(f"text_batch_invariance: {c.describe_machine()}; {args.family} {args.width} "
          f"(layers {args.layers or 'all'}) {args.precision} on {device}, {args.captions} captions, "
          f"CPU kernels {torch.backends.cpu.get_cpu_capability()}")

    results: dict[str, list[list[torch.Tensor]]] = {}
    for name, batches in partitions(args.captions):
        rows: list = [None] * args.captions
        for batch in batches:
            outputs = encode([texts[i] if i >= 0 else "" for i in batch])
            for j, i in enumerate(batch):
                if i >= 0:
                    rows[i] = [output[j] for output in outputs]
        results[name] = rows
        alone = results["alone"]
        same = [sum(torch.equal(alone[i][k], rows[i][k]) for i in range(args.captions)) for k in range(len(names))]
        worst = [max(float((alone[i][k].float() - rows[i][k].float()).abs().max()) for i in range(args.captions))
                 for k in range(len(names))]
        print(f"  {name:<14} " + "; ".join(f"{n}: {s}/{args.captions} equal to alone, max |diff| {w:.2e}"
                                            for n, s, w in zip(names, same, worst)))
    groups: list[list[str]] = []  # ways of batching that agree bit for bit on every caption and output
    for name, rows in results.items():
        for group in groups:
            other = results[group[0]]
            if all(torch.equal(a, b) for i in range(args.captions) for a, b in zip(other[i], rows[i])):
                group.append(name)
                break
        else:
            groups.append([name])
    fixed = [name for name in results if name.startswith(f"B={args.captions}")]
    fixed_agree = any(set(fixed) <= set(group) for group in groups)
    print(f"\nSUMMARY text_batch_invariance {args.family} {args.width} {args.precision} {device} "
          f"threads {torch.get_num_threads()}: agreeing groups: {' | '.join(', '.join(g) for g in groups)}; "
          f"batch size changes bits: {'yes' if len(groups) > 1 else 'no'}; one shape ({args.captions}) with any "
          f"companions agrees: {'yes' if fixed_agree else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
