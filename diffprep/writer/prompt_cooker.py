"""The Energon cooker and task encoder of a prompts dataset (``encoding: prompts``, ``diffprep raw --prompts-only``).

Apart from ``diffprep.encodings.prompts`` as the other cookers are apart from their encodings: writing a dataset
does not import Energon, which only finalize, validation and training code need.

    from diffprep.writer.prompt_cooker import PromptTaskEncoder

    dataset = get_train_dataset(path, batch_size=None, ..., task_encoder=PromptTaskEncoder())
    for sample in get_loader(dataset):
        sample.caption      # str
        sample.meta         # {"source_id": ..., and the score columns' numbers}
"""

from __future__ import annotations

import json
from typing import Any

from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, edataclass, stateless

from diffprep import contract
from diffprep.writer.layouts import Layout
from diffprep.writer.shards import SampleLoadError


@edataclass
class PromptSample(Sample):
    """One caption of a prompts dataset (``encoding: prompts``)."""

    caption: str
    #: Source id and the score columns' numbers.
    meta: dict


@stateless
def cook_prompt(sample: dict) -> PromptSample:
    """A crude prompts sample -> ``PromptSample`` (any layout's member names read back)."""
    key = sample.get("__key__", "?")
    fields = Layout.of_subflavors(sample.get("__subflavors__")).read(sample, key)
    try:
        caption = fields[contract.RAW_CAPTION].decode("utf-8")
        meta = json.loads(fields[contract.RAW_VIDEO_META])
    except KeyError as missing:
        raise SampleLoadError(f"sample {key!r} has no {missing} field (it has {sorted(fields)})") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise SampleLoadError(f"sample {key!r}: {error}") from None
    return PromptSample(**basic_sample_keys(sample), caption=caption, meta=meta)


PROMPT_COOKER = Cooker(cook_prompt, has_subflavors={"encoding": contract.ENCODING_PROMPTS})


class PromptTaskEncoder(DefaultTaskEncoder[PromptSample, PromptSample, Any, Any]):
    """Loads a prompts dataset as ``PromptSample``s (validation; a training loop reads ``txt`` directly)."""

    decoder = None
    cookers = [PROMPT_COOKER]


__all__ = ["PROMPT_COOKER", "PromptSample", "PromptTaskEncoder", "cook_prompt"]
