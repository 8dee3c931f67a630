"""LTX-2's text side before the connectors: the Gemma 3 text encoder and ltx-core's feature extractor.

The LTX-2 checkpoint's components are built by ltx-core's ``SingleGPUModelBuilder``
(``ltx2``). Two pieces cannot take that road with the versions pinned here, and
take the nearest one that works:

- Gemma: ltx-core's ``GemmaTextEncoderConfigurator`` always builds Gemma 3 12B
  (``GEMMA3_CONFIG_FOR_LTX``, a constant), and its ``GEMMA_MODEL_OPS`` fails on
  transformers 5 (it reaches for ``vision_tower.vision_model`` and
  ``rotary_emb_local``, which transformers 5 no longer has). The Gemma folder is
  therefore loaded with ``Gemma3ForConditionalGeneration.from_pretrained`` (the
  trainer's own ``--load-text-encoder-in-8bit`` road, which reads the folder's
  ``config.json``) and wrapped in ltx-core's ``GemmaTextEncoder`` and
  ``LTXVGemmaTokenizer`` (left padding to 1024, BOS first), whose ``encode``
  produces the hidden states.
- Feature extractor: ltx-core's ``EmbeddingsProcessorConfigurator`` also sizes
  it from the 12B constant and builds the connectors, which run at training
  time, not here. The extractor alone is built with ltx-core's
  ``FeatureExtractorV1``/``V2`` classes (the version chosen by ltx-core's own
  rule) at the Gemma folder's width and depth, and loaded from the checkpoint's
  ``text_embedding_projection.*`` tensors by ``SingleGPUModelBuilder``. For the
  12B folder its parameters are the same shapes as ltx-core's (tested).

Low-memory text encoder: ``text_encoder_8bit=True`` loads Gemma as the
trainer's ``--load-text-encoder-in-8bit`` does (bitsandbytes ``Linear8bitLt``
for every Linear but ``lm_head``, threshold 6.0). bitsandbytes 0.50 runs it on
the CPU as well as on CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffprep.errors import ConfigError
from diffprep.families.imports import family_imports

if TYPE_CHECKING:
    from ltx_core.text_encoders.gemma import GemmaTextEncoder

# LTXVGemmaTokenizer's length in the trainer (module_ops_from_gemma_root, gemma_8bit.py).
TEXT_MAX_LENGTH = 1024


def load_gemma(
    folder: str | Path, *, device: torch.device, dtype: torch.dtype = torch.bfloat16, load_in_8bit: bool = False
) -> GemmaTextEncoder:
    """A Gemma 3 folder -> ltx-core ``GemmaTextEncoder`` (model + ``LTXVGemmaTokenizer`` at 1024 tokens).

    ``load_in_8bit`` quantizes every Linear but ``lm_head`` to bitsandbytes
    int8 (threshold 6.0), as the trainer's ``--load-text-encoder-in-8bit``.
    """
    with family_imports("ltx2"):
        from ltx_core.text_encoders.gemma import GemmaTextEncoder
        from ltx_core.text_encoders.gemma.tokenizer import LTXVGemmaTokenizer
        from transformers import Gemma3ForConditionalGeneration

    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"the Gemma text encoder path {root} is not a folder; pass the gemma-3 folder")
    weights_dir = _find_parent(root, "model*.safetensors", "Gemma weights (model*.safetensors)")
    tokenizer_dir = _find_parent(root, "tokenizer.json", "Gemma tokenizer (tokenizer.json)")
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if load_in_8bit:
        with family_imports("ltx2"):
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                raise ConfigError("8-bit text encoder loading needs bitsandbytes: pip install bitsandbytes") from None
            from transformers import BitsAndBytesConfig
            # from_pretrained imports it for the quantized layers, outside this lock otherwise.
            import transformers.integrations.bitsandbytes  # noqa: F401

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0)
        kwargs["device_map"] = {"": str(device)}
    model = Gemma3ForConditionalGeneration.from_pretrained(str(weights_dir), **kwargs)
    if not load_in_8bit:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = LTXVGemmaTokenizer(str(tokenizer_dir), TEXT_MAX_LENGTH)
    return GemmaTextEncoder(model=model, tokenizer=tokenizer, dtype=dtype)


def create_feature_extractor_kind(transformer_config: Mapping[str, Any]) -> torch.nn.Module:
    """ltx-core's own choice of feature extractor (V1 or V2, or its error on config drift), built on the meta device."""
    with family_imports("ltx2"):
        from ltx_core.text_encoders.gemma.encoders.encoder_configurator import _create_feature_extractor

    with torch.device("meta"):
        return _create_feature_extractor(dict(transformer_config))


def build_feature_extractor(
    transformer_config: Mapping[str, Any], hidden_size: int, num_layers: int
) -> torch.nn.Module:
    """ltx-core's feature extractor for a checkpoint config, sized for a Gemma of ``hidden_size`` x ``num_layers``.

    ltx-core sizes it from Gemma 3 12B (3840 x 48); this takes the loaded Gemma's
    sizes, so a smaller Gemma (the tiny set) gets the same classes at its width.
    """
    with family_imports("ltx2"):
        from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2

    kind = create_feature_extractor_kind(transformer_config)
    flat = hidden_size * (num_layers + 1)  # every layer's output plus the embeddings
    if isinstance(kind, FeatureExtractorV1):
        return FeatureExtractorV1(aggregate_embed=torch.nn.Linear(flat, hidden_size, bias=False), is_av=kind.is_av)
    audio = kind.audio_aggregate_embed
    return FeatureExtractorV2(
        video_aggregate_embed=torch.nn.Linear(flat, kind.video_aggregate_embed.out_features, bias=True),
        embedding_dim=hidden_size,
        audio_aggregate_embed=None if audio is None else torch.nn.Linear(flat, audio.out_features, bias=True),
    )


def feature_extractor_configurator(hidden_size: int, num_layers: int) -> type:
    """A ``ModelConfigurator`` for ``SingleGPUModelBuilder`` that builds :func:`build_feature_extractor`."""

    class FeatureExtractorConfigurator:
        @classmethod
        def from_config(cls, config: dict) -> torch.nn.Module:
            return build_feature_extractor(config.get("transformer", {}), hidden_size, num_layers)

    return FeatureExtractorConfigurator


def feature_extractor_key_ops():
    """SDOps that pick the feature extractor's tensors out of an LTX-2 checkpoint."""
    with family_imports("ltx2"):
        from ltx_core.loader import SDOps

    # The checkpoint's text_embedding_projection.{aggregate_embed,video_aggregate_embed,audio_aggregate_embed}.*
    # are the extractor's own parameters (ltx-core's EMBEDDINGS_PROCESSOR_KEY_OPS maps them the same way).
    return (
        SDOps("LTX2_FEATURE_EXTRACTOR_KEY_OPS")
        .with_matching(prefix="text_embedding_projection.")
        .with_replacement("text_embedding_projection.", "")
    )


def _find_parent(root: Path, pattern: str, what: str) -> Path:
    matches = sorted(root.rglob(pattern))
    if not matches:
        raise ConfigError(f"no {what} under {root}; pass the Gemma 3 folder as downloaded")
    return matches[0].parent
