"""The ``diffprep`` command: encode, raw, ingest, decode, finalize, validate, tiny-model, demo, automation, serve.

The flags of encode, raw and ingest and their settings are ``diffprep.cli.flags``.

``encode`` runs the Prefect flow ``flows/encode.py``, ``raw`` the flow
``flows/raw.py`` (an embedded Prefect
server starts when no ``PREFECT_API_URL`` is set). Only the flags typed on the
command line override the environment and the config file: argparse
defaults are suppressed, so a flag given explicitly wins even when it equals
the default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from diffprep import contract
from diffprep.run.allocator import tune_malloc
from diffprep.cli.flags import INGEST_OUTPUT_FLAGS, RAW_FLAGS, add_flags, overrides_from
from diffprep.errors import ConfigError, DiffprepError

INTERRUPTED = 130  # the shell's code for a command ended by SIGINT

def quiet_libraries() -> None:
    """No loading bars and no warning a user cannot act on, in a terminal as in a run's log (the user's
    environment wins: ``HF_HUB_DISABLE_PROGRESS_BARS=0`` brings the bars back)."""
    # huggingface_hub and transformers read it when first imported ("Writing model shards", "Loading weights").
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # requests imports urllib3's SOCKS support to see whether PySocks is there; urllib3 warns when it is not,
    # though no SOCKS proxy is used (and one that is fails with requests' own error naming the fix).
    warnings.filterwarnings("ignore", message="SOCKS support in urllib3 requires")


def quiet_diffusers() -> None:
    """diffusers' own switch for its bars ("Loading checkpoint shards"): it does not read the environment."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes", "on"):
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


def prefect_defaults() -> None:
    """Offline, quiet, patient defaults for the embedded Prefect server (the user's environment wins)."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "diffprep")
    # A terminal run without a server logs outside any flow run (flows/recorded.py), and sends its lines after.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # OpenMP threads that spin after each parallel region take the cores the image decoders need
    # (benchmarks/README.md: 1.39x -> 1.71x over a naive loop, input-bound; compute-bound unchanged).
    # Read when torch first loads, which is after this; worker processes inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tune_malloc()  # glibc's thresholds for CPU encoders, this process (DIFFPREP_MALLOC_TUNING=0 turns it off)


def run_encode(config: str | None, overrides: dict[str, dict[str, Any]], *, raw: bool = False) -> dict:
    """Run encode-dataset, or encode-raw with ``raw``; as one of the ranks of a torchrun or srun launch, this
    rank's part (rank 0 runs the flow, the others encode their units: ``diffprep.run.launch``)."""
    prefect_defaults()
    from diffprep.run import launch
    from diffprep.config import check_runnable, load_settings
    from diffprep.phases.preflight import preflight

    shard = launch.array_shard()
    if shard is not None and not overrides.get("workers", {}).get("num_shards"):
        overrides = overrides | {"workers": overrides.get("workers", {}) | dict(zip(("num_shards", "shard_index"),
                                                                                    shard))}
    ranks = launch.detect_ranks()
    settings = load_settings(config, overrides)
    check_runnable(settings)  # fail on bad settings before Prefect starts,
    # and on what the settings name that is not there or the encoding refuses (nothing started, nothing written)
    preflight(settings, contract.ENCODING_RAW if raw else contract.ENCODING_PREENCODED)
    if ranks.many:
        quiet_diffusers()  # the encoders load in this process
        if settings.workers.num_shards is not None or settings.workers.devices or settings.workers.deployment:
            raise ConfigError(f"{ranks.launcher} starts {ranks.world_size} ranks, which share the units themselves: "
                              "remove --num-shards/--shard-index, --devices and --encode-deployment")
        if not raw:  # a raw run loads no encoder (and its parameters have no model section)
            device = launch.rank_device(settings.model.device, ranks)
            overrides = overrides | {"model": overrides.get("model", {}) | {"device": device}}
        group = launch.join(ranks, timeout_s=settings.output.approval_timeout + 3600)
        try:
            if ranks.rank != 0:
                from diffprep.phases.pipeline import follow_rank

                # No Prefect here: warnings and errors (a failure's traceback) to stderr, tagged with the rank;
                # rank 0's progress has this rank's units.
                logging.basicConfig(level=logging.WARNING,
                                    format=f"%(asctime)s | rank {ranks.rank} | %(levelname)s | %(name)s - %(message)s")
                encoding = "raw" if raw else "preencoded"
                result = follow_rank(load_settings(config, overrides), encoding, group)
            else:
                result = _run_flow(config, overrides, raw)
        except BaseException as error:
            launch.leave(error)  # the other ranks are told, by name
            raise
        launch.leave()
        return result
    return _run_flow(config, overrides, raw)


def _run_flow(config: str | None, overrides: dict[str, dict[str, Any]], raw: bool) -> dict:
    from diffprep.config import EncodeParameters, RawParameters, load_settings
    from diffprep.flows import recorded
    from diffprep.flows.startup import quiet_user_error_tracebacks

    quiet_user_error_tracebacks()
    settings = load_settings(config, overrides)
    if recorded.wanted(settings):  # no server to run the flow on: the pipeline here, recorded afterwards
        parameters = (RawParameters if raw else EncodeParameters)(config=config, **overrides)
        # diffusers is quieted once the server's process has started (its import is 2 s of this one's start-up).
        return recorded.run_recorded(settings, "raw" if raw else "preencoded", _raw_flow if raw else _encode_flow,
                                     {"parameters": parameters.model_dump(mode="json", exclude_unset=True)},
                                     then=quiet_diffusers)
    quiet_diffusers()  # the encoders load in this process
    if raw:
        from diffprep.flows.raw import encode_raw
        from diffprep.flows.startup import start_embedded_server

        start_embedded_server()
        return encode_raw(RawParameters(config=config, **overrides))
    from diffprep.flows.encode import encode_dataset
    from diffprep.flows.startup import warm_start

    warming = warm_start(settings, "preencoded")  # encoders load while the server starts
    try:
        return encode_dataset(EncodeParameters(config=config, **overrides))
    except KeyboardInterrupt:
        warming = None  # a Ctrl-C ends the command now; the loading thread is a daemon
        raise
    finally:
        if warming is not None:  # a run that ended early: nothing of it keeps loading after the command
            warming.join()


def _encode_flow():
    from diffprep.flows.encode import encode_dataset

    return encode_dataset


def _raw_flow():
    from diffprep.flows.raw import encode_raw

    return encode_raw


def print_summary(result: dict, settings: Any = None) -> None:
    """The run's summary; ``settings`` (the run's) add what they did to every image (``config.stretch_note``)."""
    print()
    if "rank" in result:  # a rank other than 0: rank 0 prints the dataset's summary
        units = ", ".join(f"{u:06d}" for u in result["units"]) or "none"
        print(f"rank {result['rank']}: encoded units {units} into {result['out_dir']}")
        return
    print(f"dataset: {result['out_dir']}  ({result['action']}, fingerprint {result['fingerprint']})")
    if result["action"] == "reuse":
        print("  reused as it is: nothing encoded, nothing changed")
        return
    if "shard" in result:
        print(f"  shard {result['shard']}: {result['encoded_units']} of {result['units']} units encoded by this run "
              f"in {result['seconds']} s; when every shard is done, run a plain `diffprep encode` with the same "
              "settings to audit, finalize and validate")
        return
    print(f"  samples written: {result['samples']}   rejected: {result['rejected']}   "
          f"units: {result['units']} ({result['encoded_units']} encoded this run)   time: {result['seconds']} s")
    from diffprep.config import stretch_note

    if settings is not None and (note := stretch_note(settings)):
        print(f"  {note}")
    for reason, count in result.get("rejects_by_reason", {}).items():
        print(f"    rejected {reason}: {count}")
    if scenes := result.get("scenes"):  # long videos: what the plan cut
        clips = ", ".join(f"{bucket} {n}" for bucket, n in scenes["clips"].items()) or "none"
        discarded = ", ".join(f"{n} {why}" for why, n in sorted(scenes["discarded"].items())) or "none"
        print(f"  long videos: {scenes['sources']} sources, {scenes['shots']} shots, {scenes['frames']} frames; "
              f"clips per bucket: {clips}; frames in no clip: {discarded}")
    for name, count in result.get("notes", {}).items():
        if count:  # an earlier diffprep's manifests may count a note at 0 (mask_not_binary without masks)
            print(f"    kept, {name}: {count}")
    if result.get("retried"):
        print(f"    retried: {result['retried']} rejected samples whose inputs changed (in new units)")
    finalize = result.get("finalize")
    if finalize:
        splits = ", ".join(f"{split} {len(shards)} shards / {finalize['counts'].get(split, 0)} samples"
                           for split, shards in finalize["splits"].items())
        if splits:
            print(f"  splits: {splits}")
        else:  # a trainer's own folders: read as they are
            parts = [p + "/" for p in finalize.get("parts", [])]
            shown = ", ".join(parts[:8]) + (f", ... ({len(parts)} in all)" if len(parts) > 8 else "")
            print(f"  no splits: the trainer reads {shown} as they are")
    validation = result.get("validation")
    if validation:
        summary = validation["summary"]
        size = summary.get("bytes_per_sample")
        print(f"  validation: {'passed' if validation['ok'] else 'FAILED'}"
              + (f"; {size} bytes per sample" if size is not None else ""))
        for kind, count in summary.get("folders", {}).items():
            print(f"    {kind}/: {count} files")
        for name, info in summary.get("fields", {}).items():
            print(f"    {name}: {', '.join(info['shapes'])} {', '.join(info['dtypes'])}")
        for kind, count in summary.get("images", {}).items():
            print(f"    images {kind}: {count}")
        previews = summary.get("previews", {})
        if previews.get("contact_sheet"):
            values = [f"{p['psnr_db']:.1f}" for p in previews["samples"] if p["psnr_db"] is not None]
            psnr = f"PSNR {', '.join(values)} dB; " if values else ""
            print(f"  previews: {psnr}contact sheet {previews['contact_sheet']}")
        elif previews:  # the note says why there are none ("no previews: ...")
            print(f"  {previews['note']}")
    else:
        print("  not finalized (--no-finalize): run `diffprep finalize OUT` when ready")


def cmd_encode(args: argparse.Namespace) -> int:
    from diffprep.config import load_settings

    overrides = overrides_from(args)
    print_summary(run_encode(args.config, overrides), load_settings(args.config, overrides))
    return 0


def cmd_raw(args: argparse.Namespace) -> int:
    from diffprep.config import load_settings

    overrides = overrides_from(args)
    print_summary(run_encode(args.config, overrides, raw=True), load_settings(args.config, overrides))
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from diffprep.tools.ingest import ingest
    from diffprep.tools.ingest_settings import SECTION, load_ingest

    overrides = overrides_from(args)
    settings, config = load_ingest(args.config, overrides, overrides.pop(SECTION, {}))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s - %(message)s")
    print_summary(ingest(settings, config).to_json())
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    if args.captioner is not None:  # a captioning model instead of an encoder set (diffprep caption)
        from diffprep.captions.tiny import write_tiny_qwen2_5_vl

        path = write_tiny_qwen2_5_vl(args.path, seed=args.seed)
        print(f"tiny Qwen2.5-VL captioner written to {path}: pass it as the captions model (random weights: for "
              "tests and demos only)")
        return 0
    if args.family == "ltx2":
        from diffprep.families.ltx2_torchaudio import require_torchaudio

        require_torchaudio()  # ltx-core's audio code needs it: a build that does not load is named with its fix
        from diffprep.families.ltx2_tiny import write_tiny_ltx2

        path = write_tiny_ltx2(args.path, seed=args.seed, text_projection=args.ltx2_text)
        print(f"tiny LTX-2 set ({args.ltx2_text} text projection) written to {path}: a single-file checkpoint and a "
              "Gemma 3 folder; pass the folder as --model-path (random weights: for tests and demos only)")
        return 0
    if args.family == "sd-vae":
        from diffprep.families.sd_vae_tiny import write_tiny_sd_vae

        path = write_tiny_sd_vae(args.path, seed=args.seed)
        print(f"tiny SD VAE (AutoencoderKL, 4 latent channels) written to {path}: pass it as --model-path "
              "(random weights: for tests and demos only)")
        return 0
    if args.family == "wan":
        from diffprep.families.wan_tiny import write_tiny_wan

        path = write_tiny_wan(args.path, seed=args.seed, vae_variant=args.wan_vae)
        print(f"tiny Wan encoder set (VAE {args.wan_vae}) written to {path} (random weights: for tests and demos only)")
        return 0
    from diffprep.families.flux_tiny import write_tiny_model

    path = write_tiny_model(args.path, seed=args.seed)
    print(f"tiny Flux encoder set written to {path} (random weights: for tests and demos only)")
    return 0


def demo_shard_size(samples: int, most: int) -> int:
    """Samples per shard of a demo of ``samples`` (at most ``most``): small enough that its train_split 0.8 gets a
    shard in each of train, val and test (`diffprep demo --samples 8` wrote one shard, and finalize refused it)."""
    size = most
    while size > 1 and -(-samples // size) < 3:
        size -= 1
    return size


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: synthetic data, tiny encoders, embedded Prefect."""
    work = Path(args.workdir)
    if args.data_only:  # the input alone, for the documentation's examples: a user's own data, made up
        from diffprep.tools.demo import write_demo_clips, write_demo_dataset

        if args.family == "wan":
            path = write_demo_clips(work / "demo-clips", samples=args.samples or 10)
        else:
            path = write_demo_dataset(work / "demo-data", samples=args.samples or 24)
        print(f"demo data written to {path}: images/ (or videos/) and captions/, paired by file stem")
        return 0
    if args.family == "wan":
        return _demo_wan(work, args.samples or 10)
    from diffprep.tools.demo import write_demo_dataset
    from diffprep.families.flux_tiny import write_tiny_model

    model = work / "tiny-flux"
    data = work / "demo-data"
    if not (model / "model_index.json").is_file():
        write_tiny_model(model)
    write_demo_dataset(data, samples=args.samples or 24)
    overrides = {
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(work / "demo-out"), "shard_size": demo_shard_size(args.samples or 24, 8),
                   "on_existing": "resume"},
        # min_psnr 0: random weights cannot reconstruct an image, whatever the settings.
        "model": {"model_path": str(model), "precision": "fp32", "batch_size": 4, "t5_max_length": 32,
                  "min_psnr": 0.0},
        "image": {"image_size": 64},
        "finalize": {"train_split": 0.8},
    }
    print_summary(run_encode(None, overrides))
    return 0


def _demo_wan(work: Path, samples: int) -> int:
    """The video demo: moving-shape clips (one in five too short for any bucket: a named reject), tiny Wan set."""
    from diffprep.tools.demo import write_demo_clips
    from diffprep.families.wan_tiny import write_tiny_wan

    model = work / "tiny-wan"
    data = work / "demo-clips"
    if not (model / "model_index.json").is_file():
        write_tiny_wan(model)
    write_demo_clips(data, samples=samples)
    overrides = {
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(work / "demo-wan-out"), "shard_size": demo_shard_size(samples, 4),
                   "on_existing": "resume",
                   "accept_rejects": 0.25},
        "model": {"model_path": str(model), "precision": "fp32", "batch_size": 2, "t5_max_length": 32,
                  "min_psnr": 0.0},
        "video": {"resolution_buckets": "64x48x9;48x64x9;48x48x9"},
        "finalize": {"train_split": 0.8},
    }
    print_summary(run_encode(None, overrides))
    return 0


def cmd_automation_create(args: argparse.Namespace) -> int:
    """Notify through a saved notification block whenever a run waits for an answer (flows/automations.py)."""
    prefect_defaults()
    from diffprep.flows.automations import cmd_automation_create as create

    return create(args.block)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve encode-dataset and validate-dataset from this process (flows/serve.py) until interrupted."""
    prefect_defaults()  # the served runs are subprocesses of this one and inherit its environment
    from diffprep.flows.serve import serve_flows

    serve_flows(limit=args.limit)
    return 0


def cmd_prefect_template(args: argparse.Namespace) -> int:
    """Build the migrated database a fresh ``PREFECT_HOME`` is seeded from (flows/prefect_home.py), once, ahead:
    in a container image, so that its first run does not pay the migrations."""
    from diffprep.flows.prefect_home import build_template, head_revision, revision_of, template_path

    path, head = template_path(), head_revision()
    if revision_of(path) == head and not args.rebuild:
        print(f"{path}: already migrated to Prefect's head ({head})")
        return 0
    build_template(path)
    print(f"{path}: built, at Prefect's head ({head}); a fresh PREFECT_HOME's embedded server starts from a copy")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffprep", description=(
        "Pre-encode diffusion training data (Flux images, Wan and LTX-2 clips) into WebDataset shards "
        "finalized as a Megatron-Energon dataset. Start with: diffprep demo; see README.md."))
    sub = parser.add_subparsers(dest="command", required=True)

    encode = sub.add_parser("encode", help="pre-encode a dataset (the encode-dataset flow on a Prefect server; without "
                            "one, run here and recorded as that flow's run)")
    add_flags(encode)
    encode.set_defaults(func=cmd_encode)

    raw = sub.add_parser("raw", help="store resized images (with --resolution-buckets: bucketed clips as mp4) and "
                         "captions without encoding (the encode-raw flow, as encode runs its own)")
    add_flags(raw, RAW_FLAGS)
    raw.set_defaults(func=cmd_raw)

    ingest = sub.add_parser("ingest", help="turn an already-encoded dataset (MLPerf Flux's Arrow files listed in a "
                            ".uri/.md5 manifest) into Energon shards, with an encode's resume, audit and validation")
    from diffprep.tools.ingest_settings import add_arguments as add_ingest_arguments

    add_flags(ingest, INGEST_OUTPUT_FLAGS,
                      config_help="YAML config: Primus's `data diffusion-ingest` sections datasets, empty_encodings, "
                                  "pipeline, and output, finalize; ${VAR} expanded; flags win over it")
    add_ingest_arguments(ingest)
    ingest.set_defaults(func=cmd_ingest)

    from diffprep.cli.dataset import add_parsers as add_dataset_parsers

    add_dataset_parsers(sub)

    from diffprep.tools.t2i_cli import add_parsers as add_t2i_parsers

    add_t2i_parsers(sub)

    from diffprep.families import FAMILIES

    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight encoder set (tests, demos)")
    tiny.add_argument("path")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--family", choices=[family.name for family in FAMILIES], default="flux",
                      help="model family layout (default flux)")
    tiny.add_argument("--ltx2-text", choices=("v1", "v2"), default="v1",
                      help="LTX-2 only: v1 (LTX-2 19B: one text projection) or v2 (LTX-2.3: video and audio ones)")
    tiny.add_argument(
        "--wan-vae", choices=("2.1", "2.2-5b"), default="2.1",
        help="Wan only: 2.1 (16 channels, 8x) or 2.2-5b (48 channels, 16x) VAE structure",
    )  # fmt: skip
    tiny.add_argument("--captioner", choices=("qwen2.5-vl",), default=None,
                      help="write a tiny captioning model (Qwen2.5-VL, for diffprep caption) instead of an encoder set")
    tiny.set_defaults(func=cmd_tiny_model)

    demo = sub.add_parser("demo", help="run the whole job on synthetic data with the tiny encoders")
    demo.add_argument("--workdir", default="demo", help="folder for the tiny model, the data and the output")
    demo.add_argument("--samples", type=int, default=None, help="samples to write (default 24 images, 10 clips)")
    demo.add_argument("--family", choices=("flux", "wan"), default="flux",
                      help="flux: images through the tiny Flux set; wan: clips through the tiny Wan set")
    demo.add_argument("--data-only", action="store_true",
                      help="write the demo data alone (DIR/demo-data; --family wan: DIR/demo-clips) and stop")
    demo.set_defaults(func=cmd_demo)

    automation = sub.add_parser("automation", help="Prefect automations of diffprep (needs PREFECT_API_URL)")
    automation_sub = automation.add_subparsers(dest="automation_command", required=True)
    create = automation_sub.add_parser(
        "create", help="notify through a saved notification block when a run waits for an answer")
    create.add_argument("--block", required=True,
                        help="the saved notification block: NAME or TYPE/NAME (e.g. slack-webhook/team)")
    create.set_defaults(func=cmd_automation_create)

    template = sub.add_parser("prefect-template", help="build, once, the migrated Prefect database that a fresh "
                              "PREFECT_HOME is seeded from (e.g. in a container image: RUN diffprep prefect-template)")
    template.add_argument("--rebuild", action="store_true", help="build it again even when it is at Prefect's head")
    template.set_defaults(func=cmd_prefect_template)

    serve = sub.add_parser("serve", help="serve the encode and validate deployments from this process "
                           "(no work pool or worker; needs PREFECT_API_URL)")
    serve.add_argument("--limit", type=int, default=None,
                       help="most runs at once (1 on a single GPU); default: no limit")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command (``argv`` None: this process's arguments, and the process ends once the command has, without
    the interpreter's teardown: ``exit_now``)."""
    quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except DiffprepError as exc:
        print(f"diffprep: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        # The run is recorded as crashed (by the flow engine, or afterwards by flows/recorded.py; the server is out
        # of the terminal's reach); every committed unit is kept and a re-run resumes from them.
        print("\ndiffprep: interrupted; the units already written are kept: run the same command again to resume",
              file=sys.stderr)
        code = INTERRUPTED
    if argv is None:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process after the exit handlers (the embedded server stopped, logs flushed), without the
    interpreter's teardown of every loaded module: seconds of deallocation after torch, transformers and Prefect
    (measured 4-8 s on 2 busy cores) that a user waits through after a Ctrl-C and after every finished run. Every
    file is committed atomically and closed, so nothing depends on that teardown."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
