"""``diffprep caption`` (a caption set for a source's images and clips) and what ``diffprep encode --caption-set``
asks before it encodes (captions over the text encoder's limit). See docs/captions.md."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from diffprep.cli.flags import ENCODE_FLAGS, add_flags, overrides_from

log = logging.getLogger("diffprep.captions")

# The source flags of encode, less those that choose a caption set (a caption run writes one).
SOURCE_FLAGS = {flag: target for flag, target in ENCODE_FLAGS.items()
                if target[0] == "source" and flag not in ("--caption-set", "--caption-index", "--on-long-caption")}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``caption`` command's parser (``diffprep.cli`` sets its function: ``run_caption_command``)."""
    parser = sub.add_parser("caption", help="caption a source's images and clips with a vision-language model into "
                            "a named caption set beside the data (the caption-dataset flow; see docs/captions.md)")
    add_flags(parser, SOURCE_FLAGS)
    parser.add_argument("--name", required=True, help="the caption set's name: <data>/.captions/NAME/ (another "
                        "name keeps the sets already there)")
    parser.add_argument("--caption-model", default=None, help="hub id or local folder of the vision-language model "
                        "(default Qwen/Qwen2.5-VL-7B-Instruct); with --server-url, the model name the server serves")
    parser.add_argument("--server-url", default=None, help="an OpenAI-compatible /v1 endpoint (vLLM) to caption "
                        "with instead of loading the model here")
    parser.add_argument("--instruction", action="append", default=None, help="the prompt (default: the peers' "
                        "one-paragraph description); repeat it for several captions per sample, one per instruction")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="the longest caption, in the model's "
                        "tokens (default 512)")
    parser.add_argument("--fps", type=float, default=None, help="frames sampled per second of a clip (default 2)")
    parser.add_argument("--max-frames", type=int, default=None, help="a clip's frames are capped at this, evenly "
                        "spread (default 256)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per captioning batch (default 16)")
    parser.add_argument("--device", default="cpu", help="the model's device in this process (cuda, cuda:1, cpu)")
    parser.add_argument("--devices", default=None, help="one captioning process per device: '0,1' (CUDA), "
                        "'cpu:N'; the units are shared and the captions are the same whatever the split")
    parser.add_argument("--unit-size", type=int, default=64, help="samples per unit: what a crash loses at most, "
                        "and what a worker takes at a time")
    parser.add_argument("--count-tokens", default=None, help="FAMILY=MODEL_FOLDER[,...]: count every caption in "
                        "that family's text-encoder tokens (flux, wan, ltx2) against its limit")
    parser.add_argument("--on-existing", choices=("overwrite",), default=None, help="a set of this name made with "
                        "other settings is replaced (asked otherwise)")
    parser.add_argument("--ltx-metadata", default=None, help="also write the LTX trainer's metadata file here "
                        "(.json, .jsonl or .csv; media paths relative to it)")
    parser.add_argument("--write-caption-files", action="store_true", help="also write captions/<stem>.txt for a "
                        "directory source (its first caption)")
    parser.add_argument("--on-replace-files", choices=("replace",), default=None, help="existing caption files or "
                        "metadata file are replaced (asked otherwise)")
    return parser


def job_from_args(args: argparse.Namespace) -> Any:
    from diffprep.captions.pipeline import CaptionJob
    from diffprep.captions.tokens import parse_count_tokens
    from diffprep.config import load_settings
    from diffprep.errors import ConfigError
    from diffprep.families.hub import resolve_token

    settings = load_settings(args.config, overrides_from(args))
    captioning = {key: value for key, value in (
        ("model", args.caption_model), ("server_url", args.server_url), ("max_new_tokens", args.max_new_tokens),
        ("fps", args.fps), ("max_frames", args.max_frames), ("batch_size", args.batch_size)) if value is not None}
    if args.unit_size < 1:
        raise ConfigError(f"--unit-size must be >= 1, got {args.unit_size}")
    job = CaptionJob(name=args.name, source=settings.source, captioning=captioning,
                     instructions=list(args.instruction or []), device=args.device, devices=args.devices,
                     unit_size=args.unit_size, count_tokens=parse_count_tokens(args.count_tokens),
                     on_existing=args.on_existing, ltx_metadata=args.ltx_metadata,
                     caption_files=args.write_caption_files, on_replace_files=args.on_replace_files,
                     hf_token=resolve_token(settings.auth.hf_token_file))
    job.settings()  # the captioning settings checked before anything starts
    return job


def run_caption_command(args: argparse.Namespace) -> int:
    """The caption flow on the server PREFECT_API_URL names, else here and recorded (as an encode is)."""
    from diffprep.errors import ConfigError
    from diffprep.flows.caption import run_command
    from diffprep.flows.startup import quiet_user_error_tracebacks
    from diffprep.run import launch

    quiet_user_error_tracebacks()
    job = job_from_args(args)
    ranks = launch.detect_ranks()
    if ranks.many:  # torchrun / srun: rank 0 runs the flow, the others caption their units (as encode's ranks)
        if job.devices:
            raise ConfigError(f"{ranks.launcher} starts {ranks.world_size} ranks, which share the units themselves: "
                              "remove --devices")
        job.device = launch.rank_device(job.device, ranks)
        group = launch.join(ranks, timeout_s=3600 * 2)
        try:
            if ranks.rank != 0:
                from diffprep.captions.pipeline import follow_rank

                logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s | rank {ranks.rank} | "
                                    "%(levelname)s | %(name)s - %(message)s")
                result = follow_rank(job, group)
            else:
                result = run_command(job)
        except BaseException as error:
            launch.leave(error)  # the other ranks are told, by name
            raise
        launch.leave()
        if ranks.rank != 0:
            print(f"rank {result['rank']}: captioned units {', '.join(f'{u:06d}' for u in result['units']) or 'none'}")
            return 0
    else:
        result = run_command(job)
    print_caption_summary(result)
    return 0


def print_caption_summary(result: dict) -> None:
    from diffprep.captions.tokens import tokens_markdown

    print()
    print(f"caption set: {result['set']}  ({result['action']}, fingerprint {result['fingerprint']})")
    audit = result.get("audit") or {}
    print(f"  samples: {result['samples']}   captioned: {audit.get('captioned')}   rejected: {audit.get('rejected')}"
          f"   units: {result['units']} ({result['captioned_units']} captioned this run)   time: {result['seconds']} s")
    for reason, count in (audit.get("by_reason") or {}).items():
        print(f"    rejected {reason}: {count}")
    print("  " + tokens_markdown(result.get("tokens") or {}).replace("\n", "\n  "))
    if result.get("ltx_metadata"):
        print(f"  LTX metadata file: {result['ltx_metadata']}")
    if result.get("caption_files") is not None:
        print(f"  caption files written: {result['caption_files']}")


# --- diffprep encode --caption-set ------------------------------------------------------------------------------------


def long_caption_overrides(settings: Any, overrides: dict[str, dict[str, Any]], ask: Any = None
                           ) -> dict[str, dict[str, Any]]:
    """Before an encode with ``--caption-set``, on the terminal: the over-long captions' question
    (``diffprep.captions.long_captions``), its answer kept in the overrides so that the run does not ask again."""
    from diffprep.captions.long_captions import long_caption_answer

    answer = long_caption_answer(settings, ask)
    if answer is None:
        return overrides
    source = overrides.get("source", {}) | {"on_long_caption": answer[0]}
    if answer[1]:
        source["caption_reject_over"] = answer[1]
    return overrides | {"source": source}
