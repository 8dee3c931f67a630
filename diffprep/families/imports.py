"""The one way the families' libraries are imported: one lock, and each family's modules imported whole, once.

transformers 5 and diffusers are lazy modules: ``from transformers import
Gemma3Config`` imports ``transformers.models.gemma3`` on first use, and
ltx-core's modules import both. Two threads importing the same package tree at
once can each hold one module's import lock while waiting for the other's
(CPython takes a submodule's lock before its parent's); Python breaks that
deadlock by handing one thread a module that is still being executed, and the
import fails or hangs (issue 35: ``cannot import name 'Gemma3Config' from
'transformers'`` in 9 of 10 terminal runs, the start-up thread loading the
encoders while the plan phase described them; ``_DeadlockError`` on
``ltx_core.model.model_protocol`` in others).

So every import of a family's libraries goes through :func:`family_imports`:

    with family_imports("ltx2"):
        from ltx_core.loader import SingleGPUModelBuilder

Under one process-wide lock, the first entry for a family imports every module
its code uses and every module its libraries' loaders import on their own while
they load (``from_pretrained`` resolving classes by name, tokenizers, weight
loading), listed in :data:`FAMILY_MODULES` and checked by
``tests/test_import_race.py``. The other thread waits at the lock for that,
then finds them all imported: the loading that goes on after the ``with``
block, outside the lock, imports nothing more, so nothing is left to race.
The list covers the family's whole code (decoders too), so that entering for a
description alone (the plan phase) costs the same imports as loading would.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FAMILY_MODULES", "family_imports", "imported_families"]

# What each family imports: a module, or ``module:Name`` for a name of a lazy module (transformers and diffusers
# import a class's module when the name is first read). The loaders' own imports were found by loading each tiny
# set after these (tests/test_import_race.py checks that nothing is left for the loading to import).
FAMILY_MODULES: dict[str, tuple[str, ...]] = {
    "flux": (
        "diffusers:AutoencoderKL",
        "transformers:CLIPTextModel", "transformers:CLIPTokenizer", "transformers:T5EncoderModel",
        "transformers:T5TokenizerFast",
    ),
    "wan": (
        "diffusers:AutoencoderKLWan",
        "transformers:AutoTokenizer", "transformers:UMT5EncoderModel", "transformers:PreTrainedTokenizerBase",
        # The tokenizer classes AutoTokenizer looks through for umT5's folder.
        "transformers.models.t5.tokenization_t5", "transformers.models.mt5",
    ),
    "ltx2": (
        "ltx_core.loader", "ltx_core.types",
        "ltx_core.model.audio_vae", "ltx_core.model.audio_vae.ops", "ltx_core.model.video_vae",
        "ltx_core.text_encoders.gemma", "ltx_core.text_encoders.gemma.tokenizer",
        "ltx_core.text_encoders.gemma.encoders.encoder_configurator", "ltx_core.text_encoders.gemma.feature_extractor",
        "transformers:Gemma3Config", "transformers:Gemma3ForConditionalGeneration",
        # Gemma 3's vision tower and the tokenizer classes LTXVGemmaTokenizer's AutoTokenizer looks through.
        "transformers.models.siglip.modeling_siglip", "transformers.models.gemma.tokenization_gemma",
        "transformers.models.diffusion_gemma",
    ),
    "sd-vae": ("diffusers:AutoencoderKL",),
    # The captioning model (diffprep/captions/models.py), its tokenizer and image processor.
    "qwen2.5-vl": ("transformers:AutoTokenizer", "transformers:PreTrainedTokenizerBase",
                   "transformers:Qwen2_5_VLForConditionalGeneration", "transformers:Qwen2VLImageProcessorPil",
                   "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"),
}

_LOCK = threading.RLock()
_IMPORTED: set[str] = set()


@contextmanager
def family_imports(family: str) -> Iterator[None]:
    """Hold the libraries' import lock for the ``with`` block's imports, ``family``'s modules imported first (once
    per process). An import that fails raises here as it would in the block, and is tried again next time."""
    if family not in FAMILY_MODULES:
        raise ValueError(f"no import list for family {family!r}; known: {', '.join(FAMILY_MODULES)}")
    with _LOCK:
        if family not in _IMPORTED:
            _import_family(family)
            _IMPORTED.add(family)
        yield


def imported_families() -> frozenset[str]:
    """The families whose modules this process has imported."""
    with _LOCK:
        return frozenset(_IMPORTED)


def _import_family(family: str) -> None:
    if family == "ltx2":
        # torchaudio first: a build that does not load beside this torch breaks transformers and diffusers too,
        # and this check says how to fix it (ltx2_torchaudio).
        from diffprep.families.ltx2_torchaudio import require_torchaudio

        require_torchaudio()
    for entry in FAMILY_MODULES[family]:
        module_name, _, name = entry.partition(":")
        module = importlib.import_module(module_name)
        if name:
            getattr(module, name)
