"""``diffprep t2i blip3o``: the BLIP3o-Pretrain hub dataset repos' ``*.tar`` files, mirrored where GAE's loader looks.

GAE's ``scripts/prepare_t2i_data.py blip3o`` downloads ``BLIP3o/BLIP3o-Pretrain-Long-Caption``,
``-Short-Caption`` and ``-JourneyDB`` (dataset repos) into ``<output>/BLIP3o-Pretrain-…/``
(``contract.T2I_SPLIT_FOLDERS``). Its loader globs ``*.tar`` in that folder only, so every tar lands at the
folder's top under its file name. A file whose size matches the hub's is complete and skipped; any other is
downloaded through ``huggingface_hub.hf_hub_download`` into ``.diffprep/tmp/`` and renamed into place, so a
killed mirror leaves no partial ``.tar`` the loader would read, and a re-run resumes.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from diffprep import contract
from diffprep.errors import ConfigError

BLIP3O_REPOS: dict[str, str] = {
    "long": "BLIP3o/BLIP3o-Pretrain-Long-Caption",
    "short": "BLIP3o/BLIP3o-Pretrain-Short-Caption",
    "journeydb": "BLIP3o/BLIP3o-Pretrain-JourneyDB",
}


@dataclass(frozen=True)
class MirrorResult:
    split: str
    repo: str
    folder: Path
    downloaded: list[str]
    skipped: list[str]


def parse_repo_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """``split=Org/Repo`` pairs; an unknown split or a malformed pair is refused with the valid ones."""
    found = {}
    for pair in pairs:
        split, sep, repo = pair.partition("=")
        if not sep or split not in BLIP3O_REPOS or "/" not in repo:
            raise ConfigError(f"--repo {pair!r}: give split=Org/Repo with split one of {sorted(BLIP3O_REPOS)}")
        found[split] = repo.strip()
    return found


def mirror_split(split: str, repo: str, output: Path, *, token: str | None = None, endpoint: str | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> MirrorResult:
    from huggingface_hub import HfApi, hf_hub_download

    # here: the CLI's parser reads this module's repos, torch not loaded
    from diffprep.writer.links import no_link_below
    from diffprep.writer.shards import fsync_dir

    # Nothing downloaded, renamed or skipped through a link inside the output: refused before the first download.
    folder = no_link_below(output, output / contract.T2I_SPLIT_FOLDERS[split])
    tmp = no_link_below(output, output / contract.STATE_DIR / contract.TMP_DIR / split)
    folder.mkdir(parents=True, exist_ok=True)
    api = HfApi(endpoint=endpoint, token=token)
    remote = sorted((entry.path, entry.size) for entry in api.list_repo_tree(repo, repo_type="dataset",
                                                                             recursive=True)
                    if getattr(entry, "size", None) is not None and entry.path.endswith(contract.SHARD_SUFFIX))
    names = [posixpath.basename(path) for path, _ in remote]
    if len(set(names)) != len(names):
        raise ConfigError(f"{repo} holds two tars of one name in different folders; GAE's loader reads one folder")
    downloaded, skipped = [], []
    for path, size in remote:
        final = no_link_below(output, folder / posixpath.basename(path))
        if final.is_file() and final.stat().st_size == size:
            skipped.append(final.name)
            continue
        got = Path(hf_hub_download(repo, path, repo_type="dataset", local_dir=tmp, token=token, endpoint=endpoint))
        if got.stat().st_size != size:
            raise ConfigError(f"{repo}/{path}: downloaded {got.stat().st_size} bytes, the hub lists {size}")
        os.replace(got, final)
        fsync_dir(folder)
        downloaded.append(final.name)
        progress(f"{split}: {final.name} ({size} bytes)")
    return MirrorResult(split, repo, folder, downloaded, skipped)


def mirror_blip3o(output: str, splits: Sequence[str], overrides: Mapping[str, str] | None = None, *,
                  token: str | None = None, endpoint: str | None = None,
                  progress: Callable[[str], None] = lambda line: None) -> list[MirrorResult]:
    out = Path(output).expanduser().resolve()
    repos = {**BLIP3O_REPOS, **(overrides or {})}
    return [mirror_split(split, repos[split], out, token=token, endpoint=endpoint, progress=progress)
            for split in splits]
