"""A tiny random-weight LTX-2 set, written offline in the real on-disk formats.

The real LTX-2 release is two things, and the tiny set copies both formats:

- one ``.safetensors`` checkpoint (``ltx-2-19b-dev.safetensors``) whose
  metadata entry ``"config"`` is a JSON document with one section per component
  (``vae``, ``audio_vae``, ``vocoder``, ``transformer``); its tensors are named
  ``vae.encoder.*``, ``vae.decoder.*``, ``vae.per_channel_statistics.*``,
  ``audio_vae.encoder.*``, ``audio_vae.decoder.*``,
  ``audio_vae.per_channel_statistics.*``, ``vocoder.*``, ``text_embedding_projection.*`` (the
  Gemma feature extractor's projection) and ``model.diffusion_model.*`` (the
  transformer). ltx-core's ``SingleGPUModelBuilder`` reads the config from the
  metadata and picks each component's tensors with its key filters
  (``VAE_ENCODER_COMFY_KEYS_FILTER`` and so on);
- a Gemma 3 folder in the Hugging Face layout (google/gemma-3-12b-it):
  ``config.json``, ``model*.safetensors`` with the original checkpoint's tensor
  names (``language_model.model.*``, ``vision_tower.vision_model.*``,
  ``multi_modal_projector.*``; no ``lm_head``, it is tied), and the tokenizer
  files.

The tiny checkpoint has no transformer (diffprep never loads it), 128 video
latent channels and the real 32x spatial / 8x temporal compression, an audio
VAE with the real latent shape ([8, T, 16] from 64 mel bins at 16 kHz), and a
vocoder (LTX-2's HiFi-GAN layout, ``vocoder.*`` tensors built by ltx-core's
``VocoderConfigurator``: the real upsampling to 24 kHz, 32 channels at its
widest) so ``diffprep decode`` can write a clip's sound back. Its per-channel statistics are random, not identity, so a
test can tell normalized from raw latents. Only widths and depths are small.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Literal

import torch

from diffprep.families.imports import family_imports

TINY_CHECKPOINT_NAME = "ltx-2-tiny.safetensors"
TINY_GEMMA_FOLDER = "gemma-3-tiny"

_WORDS = (
    "a an the of and with in on at to from by for is are its this that there "
    "video clip photo scene shot camera close up view slow motion "
    "cat dog bird horse person man woman child people tree flower grass sky cloud sun "
    "water river lake sea mountain city street house car road room window "
    "red green blue yellow white black dark light bright small large old young "
    "sitting standing walking running flying talking singing music sound voice"
).split()

# The tiny video VAE: the real encoder's block sequence (a res_x stage before and
# after each of 2x space, 2x time, 2x all, 2x all; with patch 4 that is 32x space,
# 8x time), one layer per stage and 128 channels throughout instead of doubling.
# Keeping the real sequence lets diffusers' LTX-2 conversion map it (test_ltx2).
_VAE_CONFIG: dict[str, Any] = {
    "dims": 3,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    "patch_size": 4,
    "norm_layer": "pixel_norm",
    "latent_log_var": "uniform",
    "encoder_blocks": [
        ["res_x", {"num_layers": 1}],
        ["compress_space_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
        ["compress_time_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
    ],
    "decoder_blocks": [
        ["compress_space", {"multiplier": 1}],
        ["compress_time", {"multiplier": 1}],
        ["compress_all", {"multiplier": 1}],
        ["compress_all", {"multiplier": 1}],
    ],
    "decoder_base_channels": 16,
    "causal_decoder": False,
    "timestep_conditioning": False,
}

# The tiny audio VAE: the real preprocessing (16 kHz, hop 160, n_fft 1024, 64 mel
# bins) and latent shape (8 channels x 16 frequency bins = the 128 statistics
# channels); ch must equal z_channels * mel_bins / 4, as in the real config.
_AUDIO_VAE_CONFIG: dict[str, Any] = {
    "model": {
        "params": {
            "sampling_rate": 16000,
            "ddconfig": {
                "ch": 128,
                "out_ch": 2,
                "in_channels": 2,
                "ch_mult": [1, 1, 1],
                "num_res_blocks": 1,
                "attn_resolutions": [],
                "resolution": 256,
                "z_channels": 8,
                "double_z": True,
                "mel_bins": 64,
                "norm_type": "pixel",
                "causality_axis": "height",
                "dropout": 0.0,
                "mid_block_add_attention": False,
            },
        }
    },
    "preprocessing": {
        "stft": {"filter_length": 1024, "hop_length": 160, "causal": True},
        "mel": {"n_mel_channels": 64},
    },
}

# The tiny vocoder: LTX-2's (pre-2.3) flat config, checked by ltx-core's VocoderConfigurator (resblock "1",
# stereo): 128 input channels (2 x 64 mel bins), the real upsampling 6*5*2*2*2 = 240 (100 mel frames/s ->
# 24 kHz), one resblock kernel per stage and 32 channels at the widest instead of 1024.
_VOCODER_CONFIG: dict[str, Any] = {
    "resblock": "1",
    "stereo": True,
    "upsample_rates": [6, 5, 2, 2, 2],
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_initial_channel": 32,
    "resblock_kernel_sizes": [3],
    "resblock_dilation_sizes": [[1, 3, 5]],
    "output_sampling_rate": 24000,
}

# Tiny Gemma 3: the real architecture class, 2 text layers, a 1-layer vision tower.
_GEMMA_HIDDEN = 32
_GEMMA_LAYERS = 2
_GEMMA_MAX_LENGTH = 1024

# LTX-2.3-style (V2) text projection: the width of the transformer's attention.
_V2_TRANSFORMER_CONFIG: dict[str, Any] = {
    "caption_proj_before_connector": True,
    "caption_projection_first_linear": False,
    "caption_proj_input_norm": False,
    "caption_projection_second_linear": False,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 8,
}


def write_tiny_ltx2(path: str | Path, seed: int = 0, *, text_projection: Literal["v1", "v2"] = "v1") -> Path:
    """Write the tiny LTX-2 set under ``path`` (created if missing) and return ``path``.

    ``path`` then holds ``ltx-2-tiny.safetensors`` (pass it as the checkpoint)
    and ``gemma-3-tiny/`` (pass it as the text encoder). ``text_projection``
    picks the feature extractor: ``v1`` as LTX-2 19B (one projection, audio
    embeddings are a copy of video's), ``v2`` as LTX-2.3 (separate video and
    audio projections). The same seed gives the same files.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    checkpoint = root / TINY_CHECKPOINT_NAME
    gemma_dir = root / TINY_GEMMA_FOLDER
    if checkpoint.exists() or gemma_dir.exists():
        raise FileExistsError(f"{root} already holds a tiny LTX-2 set; pass an empty or new folder")
    if text_projection not in ("v1", "v2"):
        raise ValueError(f"text_projection must be 'v1' or 'v2', got {text_projection!r}")

    tokenizer = _gemma_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gemma = _gemma_model(tokenizer)
        torch.manual_seed(seed + 1)
        tensors, config = _ltx_checkpoint_tensors(gemma.config.text_config, text_projection)

    _save_gemma_folder(gemma, tokenizer, gemma_dir)
    _save_checkpoint(checkpoint, tensors, config)
    return root


def _ltx_checkpoint_tensors(gemma_text_config, text_projection: str) -> tuple[dict[str, torch.Tensor], dict]:
    with family_imports("ltx2"):
        from ltx_core.model.audio_vae import AudioDecoderConfigurator, AudioEncoderConfigurator, VocoderConfigurator
        from ltx_core.model.video_vae import VideoDecoderConfigurator, VideoEncoderConfigurator

    transformer_config = dict(_V2_TRANSFORMER_CONFIG) if text_projection == "v2" else {}
    config = {"vae": _VAE_CONFIG, "audio_vae": _AUDIO_VAE_CONFIG, "vocoder": _VOCODER_CONFIG,
              "transformer": transformer_config}
    tensors: dict[str, torch.Tensor] = {}

    # Encoder and decoder share one set of statistics under <prefix>.per_channel_statistics.
    for prefix, configurators in (
        ("vae", (VideoEncoderConfigurator, VideoDecoderConfigurator)),
        ("audio_vae", (AudioEncoderConfigurator, AudioDecoderConfigurator)),
    ):
        channels = None
        for part, configurator in zip(("encoder", "decoder"), configurators):
            module = configurator.from_config(config)
            for name, value in module.state_dict().items():
                if name.startswith("per_channel_statistics."):
                    channels = value.shape[0]
                    continue
                tensors[f"{prefix}.{part}.{name}"] = value.detach().clone().contiguous()
        # Not identity: normalized latents must differ from the raw posterior mean.
        tensors[f"{prefix}.per_channel_statistics.mean-of-means"] = 0.2 * torch.randn(channels)
        tensors[f"{prefix}.per_channel_statistics.std-of-means"] = 0.5 + torch.rand(channels)

    # The vocoder's tensors under vocoder.* (ltx-core's VOCODER_COMFY_KEYS_FILTER strips the prefix once).
    for name, value in VocoderConfigurator.from_config(config).state_dict().items():
        tensors[f"vocoder.{name}"] = value.detach().clone().contiguous()

    hidden = gemma_text_config.hidden_size
    flat = hidden * (gemma_text_config.num_hidden_layers + 1)  # every layer's output plus the embeddings
    if text_projection == "v1":
        tensors["text_embedding_projection.aggregate_embed.weight"] = torch.randn(hidden, flat) / flat**0.5
    else:
        for kind, heads, head_dim in (
            ("video", "num_attention_heads", "attention_head_dim"),
            ("audio", "audio_num_attention_heads", "audio_attention_head_dim"),
        ):
            width = transformer_config[heads] * transformer_config[head_dim]
            tensors[f"text_embedding_projection.{kind}_aggregate_embed.weight"] = torch.randn(width, flat) / flat**0.5
            tensors[f"text_embedding_projection.{kind}_aggregate_embed.bias"] = 0.01 * torch.randn(width)

    for name, value in tensors.items():
        if not torch.isfinite(value).all():
            raise RuntimeError(f"tiny LTX-2 tensor {name} is not finite; an uninitialized parameter was saved")
    return tensors, config


def _save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    with family_imports("ltx2"):
        from safetensors.torch import save_file

    # The real checkpoint is bf16; the tiny one keeps float32 so CPU tests are exact.
    save_file(dict(sorted(tensors.items())), str(path), metadata={"config": json.dumps(config, sort_keys=True)})


def _gemma_tokenizer():
    with family_imports("ltx2"):
        from transformers import GemmaTokenizer

    # Gemma's special tokens at Gemma's ids (<pad>=0, <eos>=1, <bos>=2, <unk>=3), then
    # characters and BPE merges that spell each built-in word ("▁cat") as one token.
    vocab: dict[str, int] = {}
    for token in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"):
        vocab[token] = len(vocab)
    for char in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
    merges: dict[tuple[str, str], None] = {}
    for word in _WORDS:
        current = "▁"
        for char in word:
            merges[(current, char)] = None
            current += char
            vocab.setdefault(current, len(vocab))
    return GemmaTokenizer(
        vocab=vocab, merges=list(merges), model_max_length=_GEMMA_MAX_LENGTH, add_bos_token=True, add_eos_token=False
    )


def _gemma_model(tokenizer):
    with family_imports("ltx2"):
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vocab_size = len(tokenizer) + 4  # + boi, eoi, image tokens at the end, as in the real vocabulary
    config = Gemma3Config(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": _GEMMA_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": _GEMMA_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 16,
            "max_position_embeddings": 2048,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "vision_use_head": False,
        },
        mm_tokens_per_image=4,
        boi_token_index=vocab_size - 3,
        eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
        eos_token_id=[tokenizer.eos_token_id],
    )
    model = Gemma3ForConditionalGeneration(config)
    model.eval()
    return model


# transformers 5 names Gemma 3's tensors model.language_model.* and so on; the
# released google/gemma-3-* checkpoints (and the LTX-2 text encoder) use the
# original names, which is what ltx-core's GEMMA_LLM_KEY_OPS expects.
_GEMMA_ORIGINAL_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _save_gemma_folder(model, tokenizer, folder: Path) -> None:
    with family_imports("ltx2"):
        from safetensors.torch import save_file

    folder.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to embed_tokens; the released checkpoint does not store it
        for new, original in _GEMMA_ORIGINAL_PREFIXES:
            if name.startswith(new):
                name = original + name.removeprefix(new)
                break
        else:
            raise RuntimeError(f"unexpected Gemma tensor {name}; update _GEMMA_ORIGINAL_PREFIXES")
        tensors[name] = value.detach().clone().contiguous()
    save_file(dict(sorted(tensors.items())), str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
