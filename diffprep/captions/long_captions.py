"""Captions longer than the text encoder takes, before an encode with a caption set: a question, never a silent cut.

The caption set's token counts (``diffprep caption --count-tokens``) against the family's limit: over-long captions
are asked about (truncate / reject / abort; ``--on-long-caption`` answers ahead) from the terminal command and, for
a flow run on a server, in the UI (``diffprep.phases.pipeline.run`` asks before it plans). ``reject`` becomes
``source.caption_reject_over``, which the fingerprint covers.
"""

from __future__ import annotations

import logging
from typing import Any

from diffprep.errors import ConfigError, DiffprepError
from diffprep.run.approvals import ABORT, Question, ask_here

log = logging.getLogger("diffprep.captions")


def long_caption_answer(settings: Any, ask: Any = None) -> tuple[str, str | None] | None:
    """``(answer, reject_over)`` for an encode whose caption set has captions over its family's limit (``answer``:
    truncate or reject; ``reject_over``: ``family:limit`` with reject); None without a set, a text encoder, token
    counts or long captions. Abort raises."""
    from diffprep.captions.tokens import family_limits  # the tokenizers' libraries: only for a caption set
    from diffprep.families.hub import resolve_token
    from diffprep.families import family_of_model
    from diffprep.sources.caption_set import CaptionIndex, read_written_set, set_dir

    source = settings.source
    if not source.caption_set:
        return None
    path = set_dir(source, source.caption_set)
    record = read_written_set(path)
    model = settings.model
    if not model.model_path:
        return None  # a raw run: no text encoder
    family = family_of_model(model.model_path, model.family, revision=model.revision).name
    count = None
    if family not in (record.get("tokens") or {}):  # not counted by `diffprep caption`: counted now
        count = encode_tokenizer(family, model, resolve_token(settings.auth.hf_token_file))
        if count is None:
            log.warning("caption set %s has no %s token counts and the encode's tokenizer was not found: captions "
                        "over the text encoder's limit cannot be told apart (re-run `diffprep caption --name %s "
                        "--count-tokens %s=MODEL_FOLDER` to count them)", source.caption_set, family,
                        source.caption_set, family)
            return None
    limit = model.t5_max_length if family == "flux" else family_limits()[family]
    over, longest, first = CaptionIndex(path).over(family, limit, source.caption_index, count=count)
    if not over:
        return None
    named = "\n".join(f"- `{source_id}`: {tokens} tokens" for source_id, tokens in first)
    question = Question(key="captions-too-long", title=f"{over} captions are longer than {family}'s text "
                        f"encoder takes", description=(
                            f"Caption set **{source.caption_set}**: {over} samples have a caption over {limit} "
                            f"{family} tokens (the longest {longest}):\n\n"
                            f"{named}\n\n- **truncate**: encode them cut at {limit} tokens (counted in the notes)\n"
                            "- **reject**: leave them out, each a named `caption_too_long` reject\n"
                            "- **abort**: encode nothing (shorter captions: `diffprep caption --max-new-tokens`)"),
                        choices=("truncate", "reject", ABORT), preset_hint="--on-long-caption truncate|reject")
    answer = (ask or ask_here)(question, source.on_long_caption)
    if answer == "reject":
        return answer, f"{family}:{limit}"
    if answer == ABORT:
        raise DiffprepError(f"{over} captions of set {source.caption_set} are over {limit} {family} tokens: aborted, "
                            "nothing encoded (answer ahead with --on-long-caption truncate|reject, or caption again "
                            "shorter with diffprep caption --max-new-tokens)")
    if answer != "truncate":
        raise ConfigError(f"--on-long-caption {answer!r}: truncate or reject")
    return answer, None


def settle_long_captions(settings: Any, ask: Any) -> Any:
    """``settings`` with the over-long captions' answer in its source (asked through ``ask`` unless given)."""
    answer = long_caption_answer(settings, ask)
    if answer is None:
        return settings
    update = {"on_long_caption": answer[0]} | ({"caption_reject_over": answer[1]} if answer[1] else {})
    return settings.model_copy(update={"source": settings.source.model_copy(update=update)})


def encode_tokenizer(family: str, model: Any, token: str | None = None) -> Any:
    """A caption's token count with the tokenizer the encode will use (its model folder, or the hub's copy the
    encode downloads too), or None where it cannot be found."""
    from diffprep.captions.tokens import TOKENIZER_FOLDERS, load_tokenizer
    from diffprep.families.hub import resolve_component

    try:
        root, _ = resolve_component(model.model_path, TOKENIZER_FOLDERS[family][0] or None,
                                    revision=model.revision, token=token, encoder="tokenizer")
        tokenizer = load_tokenizer(family, str(root))
    except (DiffprepError, OSError, ValueError) as exc:
        log.info("no %s tokenizer for the caption set's counts (%s)", family, exc)
        return None
    return lambda caption: len(tokenizer(caption).input_ids)

