"""A tiny random-weight Flux encoder set, written offline in the FLUX.1-dev folder layout.

Tests, the quickstart and ``diffprep tiny-model DIR`` use it in place of the
real multi-GB encoders: every component is saved with ``save_pretrained`` and
loads back through the same ``from_pretrained`` calls as FLUX.1-dev
(``AutoencoderKL.from_pretrained(path, subfolder="vae")`` and so on). Only the
sizes are small; the classes, the folder names, the special tokens, the
16 latent channels, the 8x spatial factor and the VAE's scale/shift are the
real ones. The tokenizers are built from a small built-in word list with the
``tokenizers`` library, so nothing is downloaded.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from diffprep.families.imports import family_imports

# Words that get a whole-word token in both tokenizers; anything else is spelled
# out from smaller pieces (CLIP: bytes, T5: characters or <unk>).
_WORDS = (
    "a an the of and with in on at to from by for is are its this that there "
    "photo picture image painting drawing illustration render portrait landscape close up view "
    "cat dog bird horse person man woman child people tree flower grass sky cloud sun moon "
    "water river lake sea mountain city street house building car road table chair room window "
    "red green blue yellow white black brown orange purple pink gray dark light bright "
    "small large big tiny old young new beautiful sitting standing walking running flying "
    "background foreground detailed high quality style art digital oil watercolor sketch"
).split()

# FLUX.1-dev's VAE normalization constants (vae/config.json of the real repo).
_FLUX_SCALING_FACTOR = 0.3611
_FLUX_SHIFT_FACTOR = 0.1159

_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512
_HIDDEN = 32


def write_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny encoder set under ``path`` (created if missing) and return it.

    The same ``seed`` gives the same weights and the same files. The folder
    holds vae/, text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/,
    scheduler/ and a model_index.json naming their classes; there is no
    transformer (diffprep never loads it).
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if any((root / name).exists() for name in ("vae", "text_encoder", "text_encoder_2", "model_index.json")):
        raise FileExistsError(f"{root} already holds a model; pass an empty or new folder")

    clip_tokenizer = _clip_tokenizer()
    t5_tokenizer = tiny_t5_tokenizer()
    # fork_rng: seeding for our weights must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = _vae()
        torch.manual_seed(seed + 1)
        clip = _clip_text_model(clip_tokenizer)
        torch.manual_seed(seed + 2)
        t5 = _t5_encoder(t5_tokenizer)

    vae.save_pretrained(root / "vae")
    clip.save_pretrained(root / "text_encoder")
    clip_tokenizer.save_pretrained(root / "tokenizer")
    t5.save_pretrained(root / "text_encoder_2")
    t5_tokenizer.save_pretrained(root / "tokenizer_2")
    _scheduler().save_pretrained(root / "scheduler")
    _write_model_index(root)
    return root


def _vae():
    with family_imports("flux"):
        from diffusers import AutoencoderKL

    # Four blocks like Flux's VAE: three downsamplings, so latents are H/8 x W/8.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=_FLUX_SCALING_FACTOR,
        shift_factor=_FLUX_SHIFT_FACTOR,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _clip_tokenizer():
    with family_imports("flux"):
        from tokenizers import pre_tokenizers
        from transformers import CLIPTokenizer

    # Byte-level BPE like CLIP's: every byte is a token (alone and word-final), and
    # a chain of merges spells each built-in word as one token.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for token in alphabet + [char + "</w>" for char in alphabet]:
        vocab[token] = len(vocab)
    merges: dict[tuple[str, str], None] = {}
    for word in _WORDS:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        current = symbols[0]
        for symbol in symbols[1:]:
            merges[(current, symbol)] = None
            current += symbol
            vocab.setdefault(current, len(vocab))
    # Special tokens last, as in the real vocabulary (49406, 49407).
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=_CLIP_MAX_LENGTH)


def tiny_t5_tokenizer():
    with family_imports("flux"):
        from transformers import T5TokenizerFast

    # Unigram pieces like T5's SentencePiece model: <pad>=0, </s>=1, <unk>=2, then
    # "▁word" pieces that outscore spelling the word out character by character.
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + word, -5.0) for word in _WORDS]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(char, -10.0) for char in chars]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


def _clip_text_model(tokenizer):
    with family_imports("flux"):
        from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_HIDDEN,
        intermediate_size=64,
        projection_dim=_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def _t5_encoder(tokenizer):
    with family_imports("flux"):
        from transformers import T5Config, T5EncoderModel

    # T5 v1.1 (the XXL in FLUX.1-dev): gated GELU feed-forward, untied embeddings.
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(config)


def _scheduler():
    with family_imports("flux"):
        from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's scheduler settings; diffprep does not use the scheduler, the
    # folder only completes the layout so diffusers' FluxPipeline can load it.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def _write_model_index(root: Path) -> None:
    with family_imports("flux"):
        import diffusers

    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        # The real repo names FluxTransformer2DModel here; the tiny set has none.
        "transformer": [None, None],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
