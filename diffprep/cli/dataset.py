"""The commands over a dataset already written: ``diffprep decode``, ``finalize``, ``validate``,
``latent-stats`` and ``ignore-list`` (each takes an output folder, an ``s3://`` prefix where it can, or an LTX layout's
``--output-dir``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diffprep import contract


def cmd_decode(args: argparse.Namespace) -> int:
    from diffprep.validation.decode import decode_dataset
    from diffprep.encodings.ltx_layout import dataset_root
    from diffprep.errors import ConfigError
    from diffprep.families.hub import resolve_token
    from diffprep.sources.storage import is_s3_url

    if is_s3_url(args.out):
        raise ConfigError(f"decode reads a local dataset; copy a few shards and .diffprep/ of {args.out} first "
                          f"(e.g. aws s3 sync {args.out} ./copy --exclude '*' --include '000000.tar*' "
                          "--include '.diffprep/*'), then decode ./copy")
    report = decode_dataset(dataset_root(args.out), args.samples, to_dir=args.to, model_path=args.model_path,
                            device=args.device, token=resolve_token(args.hf_token_file))
    using = f" with the VAE at {report.vae}" if report.vae else ""
    print(f"{len(report.previews)} samples of the {report.encoding} dataset {args.out} decoded{using}; "
          "PSNR against the source as prepared for encoding:")
    for line in report.lines():
        print(f"  {line}")
    print(f"decoded PNGs in {args.to}; contact sheet (source left, decoded right): {report.contact_sheet}")
    return 0


def _s3_arguments(parser: argparse.ArgumentParser) -> None:
    """Where an s3://bucket/prefix output is; credentials come from the AWS chain (env, profile, instance role)."""
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="for an s3:// output: endpoint of a non-AWS store (default: AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--s3-profile", default=None, help="for an s3:// output: AWS profile (default: AWS_PROFILE)")


def cmd_finalize(args: argparse.Namespace) -> int:
    from diffprep.config import FinalizeConfig
    from diffprep.encodings.ltx_layout import dataset_root
    from diffprep.output import OutputRef
    from diffprep.phases.pipeline import finalize_output, validate_output

    output = OutputRef(location=dataset_root(str(args.out)), endpoint_url=args.s3_endpoint_url,
                       profile=args.s3_profile).open()
    plan = output.state.plan()
    encoding = args.encoding or (plan.encoding if plan else "preencoded")
    asked = (plan.split if plan else None) or {}  # the split the encode asked for, unless given here
    train_split = args.train_split if args.train_split is not None else asked.get("train_split", 1.0)
    seed = args.seed if args.seed is not None else asked.get("seed", 42)
    config = FinalizeConfig(train_split=train_split, shuffle_seed=seed, workers=args.workers)
    # The same phases as a run's finalize: the split question on this terminal, then validation.
    with output.lock(run=None):
        result = finalize_output(output, encoding, config, replace_split=args.replace_split)
    for split, shards in result.splits.items():
        print(f"{split}: {len(shards)} shards, {result.counts.get(split, 0)} samples")
    report = validate_output(output, encoding)
    print(report.to_markdown())
    return 0 if report.ok else 1


def cmd_validate(args: argparse.Namespace) -> int:
    from diffprep.validation import main as validate_main

    argv = [args.out]
    if args.encoding:
        argv += ["--encoding", args.encoding]
    if args.max_load:
        argv += ["--max-load", str(args.max_load)]
    if args.full:
        argv += ["--full"]
    if args.workers != 1:
        argv += ["--workers", str(args.workers)]
    if args.s3_endpoint_url:
        argv += ["--s3-endpoint-url", args.s3_endpoint_url]
    if args.s3_profile:
        argv += ["--s3-profile", args.s3_profile]
    return validate_main(argv)


def cmd_latent_stats(args: argparse.Namespace) -> int:
    from diffprep.encodings.ltx_layout import dataset_root
    from diffprep.errors import DatasetValidationError
    from diffprep.report.latent_stats import dataset_stats, has_covariance, load_stats, summary
    from diffprep.output import OutputRef
    from diffprep.validation.ownership import refuse_links
    from diffprep.writer.shards import torch_bytes

    output = OutputRef(location=dataset_root(str(args.out)), endpoint_url=args.s3_endpoint_url,
                       profile=args.s3_profile).open()
    plan = output.state.plan()
    if not args.output:
        refuse_links(output, plan)
    if plan is None:
        raise DatasetValidationError(f"{output.uri} holds no {contract.STATE_DIR}/{contract.PLAN_JSON}: not a "
                                     "diffprep dataset, or encoding has not started")
    # The file this replaces: one with the covariance is never replaced by per-channel statistics unless asked
    # (--no-full-cov), since a trainer that whitens with it (GAE) would silently lose the whitening.
    target = Path(args.output) if args.output else None
    existing = ((target.read_bytes() if target.is_file() else None) if target is not None
                else output.state.read_bytes(contract.LATENT_STATS))
    richer = has_covariance(load_stats(existing))
    full_cov = args.full_cov if args.full_cov is not None else richer
    stats = dataset_stats(output, plan, full_cov=full_cov)
    if not stats:
        raise DatasetValidationError(f"{output.uri} has no committed latents (encoding {plan.encoding!r})")
    data = torch_bytes(stats)
    if args.output:
        Path(args.output).write_bytes(data)
        where = args.output
    else:
        output.state.write_bytes(contract.LATENT_STATS, data)
        where = f"{output.uri}/{contract.STATE_DIR}/{contract.LATENT_STATS}"
    line = summary(stats)
    condition = f", condition number {line['condition']:.3g}" if "condition" in line else ""
    of = f"the {line['of']} of " if "of" in line else ""  # e.g. the posterior mean of an sd-vae archive's samples
    print(f"latent statistics of {of}{line['samples']} samples ({line['count']} values per channel, "
          f"{line['channels']} channels{condition}) written to {where}")
    if richer and args.full_cov is None:
        print("  with the full covariance, as the file it replaces held it (--no-full-cov: mean/std only)")
    return 0


def cmd_ignore_list(args: argparse.Namespace) -> int:
    from diffprep.encodings.ltx_layout import dataset_root
    from diffprep.output import OutputRef
    from diffprep.validation.ownership import refuse_links
    from diffprep.validation.ignore_list import scan_output, write_ignore_list

    output = OutputRef(location=dataset_root(str(args.out)), endpoint_url=args.s3_endpoint_url,
                       profile=args.s3_profile).open()
    if not args.check:
        refuse_links(output)  # its report goes into the state folder, the list beside the shards
    scan = scan_output(output)
    print(scan.to_markdown())
    if args.check:
        print("--check: nothing written")
    else:
        where = write_ignore_list(output, scan, args.output)
        print(f"ignore list ({scan.found} keys) written to {where}; every key's reasons in "
              f"{output.uri}/{contract.STATE_DIR}/{contract.IGNORE_REPORT_JSON}. FastGen: "
              f"ignore_index_paths=[\"{where}\"], shard_count_file unchanged")
    return 1 if scan.found else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The four commands' parsers, on the ``diffprep`` command's subparsers."""
    decode = sub.add_parser("decode", help="decode samples back to images next to their sources and print the PSNR")
    decode.add_argument("out", help="the dataset folder")
    decode.add_argument("--samples", type=int, default=8, help="samples to decode, spread over the dataset (default 8)")
    decode.add_argument("--to", required=True, metavar="DIR", help="folder for the PNGs and contact_sheet.png")
    decode.add_argument("--model-path", default=None,
                        help="the VAE (a FLUX.1-dev layout root or the vae folder); default: the one in plan.json")
    decode.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    decode.add_argument("--hf-token-file", default=None, help="token file, when the VAE is a gated hub repo")
    decode.set_defaults(func=cmd_decode)

    finalize = sub.add_parser("finalize", help="(re)write the Energon metadata of an output, then validate it")
    finalize.add_argument("out")
    finalize.add_argument("--train-split", type=float, default=None, help="share of shards for train; the rest "
                          "split evenly into val and test (default: the encode's --train-split, else 1.0)")
    finalize.add_argument("--encoding", choices=contract.ENCODINGS, default=None)
    finalize.add_argument("--seed", type=int, default=None, help="split seed (default: the encode's, else 42)")
    finalize.add_argument("--workers", type=int, default=2)
    finalize.add_argument("--replace-split", action="store_true",
                          help="reassign every shard (moves shards between splits; held-out data may enter train)")
    _s3_arguments(finalize)
    finalize.set_defaults(func=cmd_finalize)

    validate = sub.add_parser("validate", help="strictly validate a finalized dataset (exit 1 on any failure)")
    validate.add_argument("out")
    validate.add_argument("--encoding", choices=contract.ENCODINGS, default=None)
    validate.add_argument("--max-load", type=int, default=None, help="load at most N samples per split")
    validate.add_argument("--full", action="store_true", help="load every sample (default: one drawn from each "
                          "shard; every shard's headers, count and digest are checked either way)")
    validate.add_argument("--workers", type=int, default=1, help="with --full: load in N processes (same report)")
    _s3_arguments(validate)
    validate.set_defaults(func=cmd_validate)

    stats = sub.add_parser("latent-stats", help="per-channel mean/std (and with --full-cov the covariance and its "
                           "whitening) of every stored latent of a finished dataset, without re-encoding")
    stats.add_argument("out", help="the output folder, s3://bucket/prefix, or an LTX layout's --output-dir")
    stats.add_argument("--full-cov", action=argparse.BooleanOptionalAction, default=None,
                       help="also the channel covariance, whiten = cov^-1/2 and unwhiten = cov^1/2 (ZCA); default: "
                            "as the file it replaces (one with the covariance keeps it); --no-full-cov: mean/std only, "
                            "even over a file with the covariance")
    stats.add_argument("--output", default=None, metavar="FILE",
                       help=f"where to write the statistics (default: OUT/{contract.STATE_DIR}/{contract.LATENT_STATS})")
    _s3_arguments(stats)
    stats.set_defaults(func=cmd_latent_stats)

    ignore = sub.add_parser("ignore-list", help="read every sample of a finished dataset and write FastGen's "
                            f"ignore list ({contract.IGNORE_INDEX_JSON}) of the broken ones (exit 1 when any)")
    ignore.add_argument("out", help="the output folder or s3://bucket/prefix")
    ignore.add_argument("--output", default=None, metavar="FILE",
                        help=f"a local path for the list (default: OUT/{contract.IGNORE_INDEX_JSON}, beside the tars)")
    ignore.add_argument("--check", action="store_true", help="scan and report only; write nothing")
    _s3_arguments(ignore)
    ignore.set_defaults(func=cmd_ignore_list)
