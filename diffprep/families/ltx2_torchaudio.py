"""torchaudio where its compiled extension cannot load: the one fix that lets ltx-core's audio code import.

ltx-core (the LTX-2 family) depends on torchaudio, and the registry's torchaudio
2.11.1 wheel is a CUDA build: next to a CPU torch, ``import torchaudio`` fails
while its ``torchaudio._extension`` loads ``_torchaudio.so`` (``OSError:
libc10_cuda.so``). Once torchaudio is installed, that failure is not ltx-core's
alone: transformers (``audio_utils``, reached from its processors) and diffusers
(``loaders.single_file_model``, reached from every model class) import torchaudio
whenever it is installed, so a CPU machine with the ``test`` extra could not load
even a Flux VAE. What any of them uses of torchaudio here -- ltx-core's
``MelSpectrogram`` and ``functional.resample`` -- is pure torch and never touches
the extension.

:func:`allow_torchaudio_without_extension` (run by ``import diffprep``, so before
anything imports torchaudio) puts a finder in front of ``sys.meta_path`` for the
module ``torchaudio._extension`` alone. Its real code runs as it is; only if it
raises ``OSError`` are the three names set that the module itself sets when no
extension is built (``_IS_TORCHAUDIO_EXT_AVAILABLE`` and ``_IS_ALIGN_AVAILABLE``
False, ``fail_if_no_align`` a decorator that makes the alignment functions
refuse when called), so torchaudio imports and its extension-only functions
refuse as on such a build. Where the extension loads (a torchaudio that matches
torch), nothing changes. No torch or torchaudio import happens here.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

EXTENSION_MODULE = "torchaudio._extension"


def allow_torchaudio_without_extension() -> None:
    """Install the ``torchaudio._extension`` fallback (idempotent; see the module docstring)."""
    if not any(isinstance(finder, _ExtensionFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ExtensionFinder())


class _ExtensionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != EXTENSION_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _FallbackLoader(spec.loader)
        return spec


class _FallbackLoader(importlib.abc.Loader):
    """The real loader; an ``OSError`` while the extension library loads ends as torchaudio's no-extension state."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        except OSError as error:
            module._IS_TORCHAUDIO_EXT_AVAILABLE = False
            module._IS_ALIGN_AVAILABLE = False
            module.fail_if_no_align = _refuse_without_extension
            module.load_error = f"{type(error).__name__}: {error}"


def _refuse_without_extension(function):
    @functools.wraps(function)
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"torchaudio.{function.__name__} needs torchaudio's compiled extension, which does not load with this "
            "torch (diffprep.families.ltx2_torchaudio); install a torchaudio build that matches torch"
        )

    return refuse
