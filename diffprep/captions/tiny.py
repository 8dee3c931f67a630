"""A tiny random-weight Qwen2.5-VL, written offline as a hub folder of the real model is laid out.

``diffprep tiny-model DIR --captioner qwen2.5-vl`` writes it; the tests and the
benchmark caption with it in place of the 7B model. The model is built from a
config alone (as transformers' own tests build theirs): the real classes
(``Qwen2_5_VLForConditionalGeneration``, its vision tower with windowed
attention, M-RoPE), only the sizes small. The tokenizer is a byte-level BPE
made here with the ``tokenizers`` library from a small word list, holding
Qwen's special tokens (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>``,
``<|video_pad|>``...) and a chat template of Qwen2.5-VL's shape (a default
system turn, a vision span per image or video part). The image processor is
Qwen2-VL's with a small pixel budget, so a test image costs a few tokens.

Nothing is downloaded; the same seed writes the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffprep.errors import ConfigError

__all__ = ["SPECIAL_TOKENS", "write_tiny_qwen2_5_vl"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")

# Words that get a token of their own; anything else is spelled from bytes.
_WORDS = (
    "a an the of and with in on at to from by for is are this that video image frames frame second seconds "
    "describe detail one paragraph say who what main subjects like they do how move setting background lighting "
    "colours camera frames moves only can be seen plain prose without preamble lists speculation if it single "
    "same way system you helpful assistant user red green blue white black dark light person cat dog car sky "
    "tree water moving still left right up down slowly quickly"
).split()

# Qwen2.5-VL's chat template, reduced to what captioning uses: a system turn ("You are a helpful assistant."
# unless one is given), user turns whose content is a string or a list of image / video / text parts.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Pixel budgets: an image between 56x56 and 28*28*64 pixels (4 to 64 merged tokens); a video frame at most
# 28*28*16 (16 per two frames).
_IMAGE_PIXELS = (56 * 56, 28 * 28 * 64)
_VIDEO_PIXELS = (28 * 28 * 4, 28 * 28 * 16)
_HIDDEN = 32
# Weights drawn wider than transformers' 0.02, so that the pixels move the logits: with the default, every input got
# the same caption and a test comparing captions could not see a wrong pixel.
_INIT = 0.5


def write_tiny_qwen2_5_vl(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model, its tokenizer and processor under ``path`` (created if missing) and return it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if (root / "config.json").exists() or (root / "tokenizer.json").exists():
        raise ConfigError(f"{root} already holds a model; pass an empty or new folder (nothing was written)")

    tokenizer = _tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": _HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1_000_000.0},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "initializer_range": _INIT,
        },
        vision_config={
            "depth": 2, "hidden_size": _HIDDEN, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": _HIDDEN,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
            "fullatt_block_indexes": [1], "tokens_per_second": 2, "initializer_range": _INIT,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    # fork_rng: seeding our weights must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(root)

    # The processor's parts are saved one by one: Qwen2_5_VLProcessor itself cannot be built where torchvision is
    # missing (its video processor needs it), and the captioner loads the parts alone (models.py).
    tokenizer.save_pretrained(root)
    Qwen2VLImageProcessorPil(size={"shortest_edge": _IMAGE_PIXELS[0], "longest_edge": _IMAGE_PIXELS[1]},
                             ).save_pretrained(root)
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_video_processor_config(root)
    _write_processor_config(root)
    return root


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE as Qwen's: every byte is a token, and a chain of merges spells each built-in word as one.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {token: i for i, token in enumerate(alphabet)}
    merges: dict[tuple[str, str], None] = {}
    space = "\u0120"  # the byte-level form of a leading space
    for word in _WORDS:
        for spelled in (word, space + word):
            current = spelled[0]
            for char in spelled[1:]:
                merges[(current, char)] = None
                current += char
                vocab.setdefault(current, len(vocab))
    bpe = models.BPE(vocab=vocab, merges=list(merges))
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        model_max_length=32768, extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                                      "vision_bos_token": "<|vision_start|>",
                                                      "vision_eos_token": "<|vision_end|>"},
    )


def _write_video_processor_config(root: Path) -> None:
    """The video processor's settings as transformers writes them (its class cannot be built without torchvision)."""
    import json

    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    config = {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "size": {"shortest_edge": _VIDEO_PIXELS[0], "longest_edge": _VIDEO_PIXELS[1]},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD), "do_convert_rgb": True, "resample": 3, "do_sample_frames": False,
    }
    (root / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                                          encoding="utf-8")


def _write_processor_config(root: Path) -> None:
    """processor_config.json as the hub's Qwen2.5-VL has it, so AutoProcessor (with torchvision) loads the folder."""
    import json

    (root / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2)
                                                + "\n", encoding="utf-8")
