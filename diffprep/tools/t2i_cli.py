"""The ``diffprep t2i …`` and ``diffprep verify-t2i`` commands (GAE's text-to-image co-training roots)."""

from __future__ import annotations

import argparse


def cmd_t2i_imagenet(args: argparse.Namespace) -> int:
    from diffprep.tools.t2i import pack_imagenet

    result = pack_imagenet(args.input_dir, args.output, shard_size=args.shard_size, seed=args.seed,
                           class_names=args.class_names, caption_template=args.caption_template, progress=print)
    print(f"{result.samples} samples in {result.shards} shard(s) in {result.out} ({len(result.written)} written "
          f"by this run); {len(result.rejects)} rejected")
    for item in result.rejects[:10]:
        print(f"  rejected {item.source_id}: {item.reason} {item.detail}")
    if result.vanished:
        print(f"{len(result.vanished)} planned file(s) are no longer in the source; their shards are kept")
    # pack_imagenet wrote it under the folder name GAE's loader looks for, so its parent is the data_dir to give.
    print(f"GAE reads it as split 'imagenet' ({result.out.name}/) with cotrain_t2i.dataset.data_dir including "
          f"{result.out.parent}")
    return 0


def cmd_verify_t2i(args: argparse.Namespace) -> int:
    from diffprep.tools.t2i_verify import format_reports, verify_roots

    reports = verify_roots(list(args.roots), args.splits)
    print(format_reports(reports))
    return 0 if reports and all(report.ok for report in reports) else 1


def cmd_t2i_blip3o(args: argparse.Namespace) -> int:
    from diffprep.tools.t2i_mirror import mirror_blip3o, parse_repo_overrides

    results = mirror_blip3o(args.output, args.splits, parse_repo_overrides(args.repo), progress=print)
    for result in results:
        print(f"{result.split}: {result.repo} -> {result.folder}: {len(result.downloaded)} downloaded, "
              f"{len(result.skipped)} already complete")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from diffprep import contract

    t2i = sub.add_parser("t2i", help="GAE's text-to-image co-training data (ImageNet shards, BLIP3o mirror)")
    t2i_sub = t2i.add_subparsers(dest="t2i_command", required=True)
    imagenet = t2i_sub.add_parser("imagenet", help="pack class folders (ImageNet's train/) as GAE's "
                                  f"{contract.T2I_SPLIT_FOLDERS['imagenet']}/imagenet_*.tar with .done markers")
    imagenet.add_argument("--input-dir", required=True, help="the class folders: <input-dir>/<wnid>/<image>")
    imagenet.add_argument("--output", required=True,
                          help=f"the split folder, named {contract.T2I_SPLIT_FOLDERS['imagenet']} (GAE's loader reads "
                               f"no other name; its parent is the data_dir), e.g. $GAE_DATA_ROOT/Blip3o_style/"
                               f"{contract.T2I_SPLIT_FOLDERS['imagenet']}")
    imagenet.add_argument("--shard-size", type=int, default=contract.T2I_SHARD_SIZE)
    imagenet.add_argument("--seed", type=int, default=contract.T2I_SEED, help="the shuffle's seed (kept in the plan)")
    imagenet.add_argument("--class-names", default=None, help="one name per class folder, sorted order")
    imagenet.add_argument("--caption-template", default=None, help="e.g. 'a photo of a {label}' (default: "
                          "the class name)")
    imagenet.set_defaults(func=cmd_t2i_imagenet)

    from diffprep.tools.t2i_mirror import BLIP3O_REPOS

    blip3o = t2i_sub.add_parser("blip3o", help="mirror the BLIP3o-Pretrain hub repos' *.tar into the folders "
                                "GAE's loader reads (resumable)")
    blip3o.add_argument("--output", required=True, help="e.g. $GAE_DATA_ROOT/BLIP3o")
    blip3o.add_argument("--splits", nargs="+", choices=list(BLIP3O_REPOS), default=list(BLIP3O_REPOS))
    blip3o.add_argument("--repo", nargs="*", default=[], metavar="SPLIT=ORG/REPO",
                        help="another source repo for a split, e.g. long=Org/Repo")
    blip3o.set_defaults(func=cmd_t2i_blip3o)

    verify = sub.add_parser("verify-t2i", help="what GAE's T2I loader finds under its roots, every shard read "
                            "(exit 1 on anything missing)")
    verify.add_argument("roots", nargs="+", help="the loader's data_dir roots, in its order")
    verify.add_argument("--splits", nargs="+", choices=sorted(contract.T2I_SPLIT_FOLDERS), default=None,
                        help="default: every split whose folder exists under a root")
    verify.set_defaults(func=cmd_verify_t2i)
