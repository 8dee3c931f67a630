"""Every caption's length in each model family's text-encoder tokens, against that encoder's limit.

A caption longer than the encoder takes is cut by the encoder without a word (Flux's and Wan's T5 at 512 tokens,
LTX-2's Gemma at 1024): the caption run counts each caption with the family's own tokenizer (``--count-tokens
FAMILY=MODEL``, the model folder the encode will use), records the counts with the set, and reports how many are
over; ``diffprep encode --caption-set`` asks what to do with those (truncate, reject, abort) before encoding.

The limits are the families' own settings: Flux's ``t5_max_length`` default, Wan's and LTX-2's
``TEXT_MAX_LENGTH``. Counts include the special tokens the encoder adds (T5's ``</s>``, Gemma's ``<bos>``), as the
encoder's truncation does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from diffprep.errors import ConfigError

# Where each family keeps the tokenizer of its (longest) text encoder, in a model folder; the folder itself last
# (LTX-2's --text-encoder-path is the Gemma folder).
TOKENIZER_FOLDERS = {"flux": ("tokenizer_2",), "wan": ("tokenizer",), "ltx2": ("tokenizer", "text_encoder", "")}
OVER_LISTED = 20  # samples named per family in the report


def family_limits() -> dict[str, int]:
    """Each family's text-encoder limit, from the families' settings."""
    from diffprep.config import ModelConfig
    from diffprep.families.ltx2_gemma import TEXT_MAX_LENGTH as GEMMA_MAX
    from diffprep.families.wan import TEXT_MAX_LENGTH as WAN_MAX

    return {"flux": ModelConfig().t5_max_length, "wan": WAN_MAX, "ltx2": GEMMA_MAX}


def parse_count_tokens(spec: str | None) -> dict[str, str]:
    """``flux=/models/flux,wan=/models/wan`` -> {family: folder}; unknown families refused with the known ones."""
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        family, sep, path = part.partition("=")
        if not sep or not path:
            raise ConfigError(f"--count-tokens {part!r}: give FAMILY=MODEL_FOLDER, e.g. flux=/models/FLUX.1-dev")
        if family not in TOKENIZER_FOLDERS:
            raise ConfigError(f"--count-tokens: unknown family {family!r}; one of {', '.join(TOKENIZER_FOLDERS)}")
        found[family] = path
    return found


def load_tokenizer(family: str, folder: str) -> Any:
    """The family's tokenizer from a local model folder (never downloaded: the encode uses the same folder)."""
    from transformers import AutoTokenizer

    for sub in TOKENIZER_FOLDERS[family]:
        where = os.path.join(folder, sub) if sub else folder
        if any(os.path.exists(os.path.join(where, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(where, local_files_only=True)
    looked = ", ".join(os.path.join(folder, s) if s else folder for s in TOKENIZER_FOLDERS[family])
    raise ConfigError(f"--count-tokens {family}={folder}: no tokenizer in {looked}; give the {family} model folder "
                      "the encode will use")


class TokenCounter:
    """The tokenizers of the families asked for, loaded once per process."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.tokenizers = {family: load_tokenizer(family, folder) for family, folder in sorted(folders.items())}

    def count(self, captions: list[str]) -> dict[str, list[int]]:
        return {family: [len(tokenizer(caption).input_ids) for caption in captions]
                for family, tokenizer in self.tokenizers.items()}


class TokenTally:
    """Per family, over a set's samples: how many counted, the longest, how many over the limit (and which)."""

    def __init__(self, families: Iterable[str]) -> None:
        self.limits = {family: limit for family, limit in family_limits().items() if family in set(families)}
        self.stats = {family: {"limit": limit, "samples": 0, "longest": 0, "over": 0, "over_samples": []}
                      for family, limit in self.limits.items()}

    def add(self, source_id: str, tokens: dict[str, list[int]]) -> None:
        for family, counts in tokens.items():
            stats = self.stats.get(family)
            if stats is None or not counts:
                continue
            stats["samples"] += 1
            longest = max(counts)
            stats["longest"] = max(stats["longest"], longest)
            if longest > stats["limit"]:
                stats["over"] += 1
                if len(stats["over_samples"]) < OVER_LISTED:
                    stats["over_samples"].append({"source_id": source_id, "tokens": longest})

    def to_json(self) -> dict[str, Any]:
        return self.stats


def tokens_markdown(stats: dict[str, Any]) -> str:
    """The token report as a Markdown table (the run's summary and artifact)."""
    if not stats:
        return "token counts: none asked (`--count-tokens FAMILY=MODEL_FOLDER`)"
    lines = ["| family | limit | samples | longest | over the limit |", "|---|---|---|---|---|"]
    for family, s in sorted(stats.items()):
        lines.append(f"| {family} | {s['limit']} | {s['samples']} | {s['longest']} | {s['over']} |")
    return "\n".join(lines)


__all__ = ["TOKENIZER_FOLDERS", "TokenCounter", "TokenTally", "family_limits", "load_tokenizer",
           "parse_count_tokens", "tokens_markdown"]
