"""Which files of an output diffprep wrote: what an approved overwrite removes, and what it must leave alone.

A file is diffprep's when its own records name it:

- a shard (and the Energon index beside it), or a trainer-layout file, that a
  unit manifest lists or the output's plan plans (a unit that died between its
  shard and its manifest leaves a shard the plan still names);
- a metadata file diffprep writes by name: ``.nv-meta``'s (``dataset.yaml`` and
  the files Energon's prepare writes), the empty encodings, a layout's files at
  the top;
- a state file of ``.diffprep`` (plan, manifests, reports, sanity and scratch);
  the runs' locks are diffprep's too, but an overwrite keeps them;
- a temporary file of any of these, named by ``shards.temp_name``.

Every other file is foreign, wherever it sits (``.nv-meta/custom/``,
``empty_encodings/``, ``latents/``...): an overwrite lists it in its question
and keeps it byte for byte. A foreign file that this run would write over, or
that the trainer would read as a sample, blocks the overwrite instead.

A symbolic link is always foreign, whatever its name, and never followed: a
link at a path this run writes, or a folder link above one (``empty_encodings``,
``.nv-meta``, ``.precomputed/latents``, anything in ``.diffprep``), blocks the
run whatever is chosen but ``new-dir``, ``reuse`` and ``abort``: writing there
would change the files it points at, outside the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from diffprep import contract
from diffprep.report.pictures import CONTACT_SHEET
from diffprep.writer.plan import Plan
from diffprep.run.manifests import Manifests
from diffprep.errors import LinkInOutputError
from diffprep.writer.links import link_message
from diffprep.writer.shards import TEMP_SUFFIX, UnitManifest

# Energon's names in .nv-meta (megatron.energon.flavors.webdataset.config) and diffprep's dataset.yaml.
NV_META_FILES = frozenset({contract.DATASET_YAML, contract.SPLIT_YAML, contract.INFO_JSON, contract.INDEX_SQLITE,
                           contract.INDEX_UUID, contract.INFO_YAML})
EMPTY_ENCODINGS = frozenset({contract.T5_EMPTY, contract.CLIP_EMPTY, contract.PROMPT_EMBEDS_EMPTY})
STATE_FILES = frozenset({contract.PLAN_JSON, contract.T2I_PLAN_JSON, contract.AUDIT_JSON, contract.VALIDATION_JSON,
                         contract.SPLITS_JSON, contract.REJECTS_ANSWER_JSON, contract.DISCARD_ANSWER_JSON,
                         contract.LATENT_STATS, contract.EMPTY_PROMPT, contract.MSC_CONFIG, CONTACT_SHEET,
                         contract.IGNORE_REPORT_JSON})
WRITTEN_FOLDERS = frozenset({contract.STATE_DIR, contract.NV_META, contract.EMPTY_ENCODINGS_DIR})
SANITY_FILES = frozenset({contract.SANITY_REPORT, contract.SANITY_SAMPLE, CONTACT_SHEET})
_MANIFEST_RE = re.compile(r"\d{6,}\.json")
_TEMP_SHARD_RE = re.compile(r"\d{6,}\.tar\..+\.\d+" + re.escape(TEMP_SUFFIX))  # ShardWriter's, in tmp/
_CACHED_TEXT_RE = re.compile(r"[0-9a-f]+/(?:[^/]+/)?[0-9a-f]{64}\.pt")  # <fingerprint>/[<host>/]<sha256>.pt
_TEMP_RE = re.compile(r"\.(?P<rest>.+)\.\d+" + re.escape(TEMP_SUFFIX))  # shards.temp_name's, hidden (atomic writes)
SHOWN = 10  # files named in a question; the rest are counted


@dataclass(frozen=True)
class Ownership:
    """An output's files (paths relative to it, ``/``-separated), sorted by who wrote them."""

    ours: tuple[str, ...]  # what an approved overwrite removes
    locks: tuple[str, ...]  # diffprep's, kept: the run doing the overwrite holds one
    foreign: tuple[str, ...]  # not diffprep's: listed, kept
    links: tuple[str, ...] = ()  # symbolic links (among ``foreign``): never written through

    def blocking(self, plan: Plan) -> list[str]:
        """Foreign files an overwrite with ``plan`` cannot keep: this run writes files of their names, or the
        trainer reads them as samples beside the new ones; the links in this run's way (``links_in_the_way``), and
        every link where the trainer globs the output's folders (it would read through them)."""
        writes = set(planned_files(plan))
        globbed = trainer_globs(plan)
        return [name for name in self.foreign if name in writes or read_as_data(name, plan)
                or name in self.links and (globbed or in_the_way(name, writes))]

    def links_in_the_way(self, plan: Plan | None) -> list[str]:
        """The links where a run of ``plan`` (None: a command over a written dataset) writes, or above it."""
        writes = set(planned_files(plan)) if plan is not None else set()
        return [name for name in self.links if in_the_way(name, writes)]


def in_the_way(link: str, writes: set[str]) -> bool:
    """Whether a run that writes ``writes`` (and diffprep's state, metadata and empty encodings, by name) would write
    at the link ``link`` or below it."""
    folder, _, rest = link.partition("/")
    if folder == contract.STATE_DIR or (not rest and folder in WRITTEN_FOLDERS):
        return True  # the state folder is diffprep's throughout; the others are written by name
    if link in writes or named_by_name(link):
        return True
    below = link + "/"
    return any(name.startswith(below) for name in writes)


def state_file(relative: str) -> bool:
    """Whether ``relative`` (inside ``.diffprep``) is a state file diffprep writes."""
    folder, _, rest = relative.partition("/")
    if not rest:
        return folder in STATE_FILES
    if folder == contract.UNITS_DIR:
        return _MANIFEST_RE.fullmatch(rest) is not None
    if folder == contract.PLAN_UNITS_DIR:  # each planned unit's sample list
        return re.fullmatch(r"\d{6,}\.jsonl", rest) is not None
    if folder == contract.MEMBERS_DIR:  # a shard's members as written (diffprep.writer.shards.write_members)
        return _MANIFEST_RE.fullmatch(rest) is not None
    if folder == contract.UNIT_STATS_DIR:  # --full-cov: a unit's latent moments
        return re.fullmatch(r"\d{6,}\.pt", rest) is not None
    if folder == contract.SANITY_DIR:
        return rest in SANITY_FILES
    if folder == contract.TMP_DIR:
        return _TEMP_SHARD_RE.fullmatch(rest) is not None
    if folder == contract.TEXT_CACHE_DIR:
        return _CACHED_TEXT_RE.fullmatch(rest) is not None
    if folder == contract.DOWNLOADS_DIR:  # an ingest's files waiting for their unit (plain names, no folders)
        return "/" not in rest
    return False


def named_by_name(path: str) -> bool:
    """Whether diffprep writes the file at ``path`` by its name alone (metadata and state; not a lock)."""
    folder, _, rest = path.partition("/")
    if not rest:
        return folder in contract.LAYOUT_FILES
    if folder == contract.STATE_DIR:
        return state_file(rest)
    if folder == contract.NV_META:
        return rest in NV_META_FILES
    if folder == contract.EMPTY_ENCODINGS_DIR:
        return rest in EMPTY_ENCODINGS
    return False


def data_files(manifests: Mapping[int, UnitManifest], plan: Plan | None) -> set[str]:
    """The shards, their indexes and the layout files that diffprep's manifests list and its plan plans."""
    names: set[str] = set()
    for manifest in manifests.values():
        if manifest.shard:
            names.update((manifest.shard, contract.index_name(manifest.shard)))
        names.update(manifest.files or ())
    if plan is not None:
        names.update(planned_files(plan))
    return names


def planned_files(plan: Plan) -> list[str]:
    """Every data file a run of ``plan`` writes: its shards and their indexes, or its layout's files."""
    from diffprep.encodings import edm_zip, unit_files_layout

    files_layout = unit_files_layout(plan)
    if files_layout is not None:  # the LTX trainer's records, GAE's scene folders
        return files_layout.planned_files(plan)
    shards = [contract.shard_name(unit.unit) for unit in plan.units]
    archive = edm_zip.planned_files(plan) if edm_zip.is_edm_zip(plan) else []  # dataset.zip, assembled at finalize
    return shards + [contract.index_name(name) for name in shards] + archive


def trainer_globs(plan: Plan) -> bool:
    """Whether the trainer of ``plan``'s layout finds its samples by listing folders (LTX, GAE), not by names."""
    from diffprep.encodings import unit_files_layout

    return unit_files_layout(plan) is not None


def read_as_data(path: str, plan: Plan) -> bool:
    """Whether the trainer of ``plan``'s layout reads the file at ``path`` as a sample (the LTX trainer globs its
    record folders, GAE its scene folders; Energon reads only the shards its metadata names)."""
    from diffprep.encodings import unit_files_layout

    files_layout = unit_files_layout(plan)
    return files_layout is not None and files_layout.read_by_trainer(path)


def classify(files: list[str], manifests: Mapping[int, UnitManifest], plan: Plan | None,
             links: list[str] | tuple[str, ...] = ()) -> Ownership:
    """Sort ``files`` (every file of an output; ``links``: those that are symbolic links) by who wrote them (the
    module docstring)."""
    named = data_files(manifests, plan)

    def is_ours(path: str) -> bool:
        return path in named or named_by_name(path)

    ours, locks, foreign = [], [], []
    linked = set(links)
    for path in sorted(set(files) | linked):
        folder, _, rest = path.partition("/")
        if path in linked:
            foreign.append(path)
        elif folder == contract.STATE_DIR and contract.is_lock_file(rest):
            locks.append(path)
        elif is_ours(path) or any(is_ours(target) for target in temp_targets(path)):
            ours.append(path)
        else:
            foreign.append(path)
    return Ownership(tuple(ours), tuple(locks), tuple(foreign), tuple(sorted(linked)))


def temp_targets(path: str) -> list[str]:
    """The files a temporary file at ``path`` may have been written for (``shards.atomic_write_bytes`` names it
    ``.<name>.<host>.<pid>.tmp`` beside its target; a host name may hold dots, so every cut is a candidate)."""
    parent, _, base = path.rpartition("/")
    match = _TEMP_RE.fullmatch(base)
    if not match:
        return []
    rest = match.group("rest")
    prefix = parent + "/" if parent else ""
    return [prefix + rest[:i] for i, char in enumerate(rest) if char == "."]


def ownership(output: Any) -> Ownership:
    """Who wrote each file of ``output`` (a folder or a bucket prefix), by its manifests and its plan."""
    files, links = output.listing()
    return classify(files, Manifests(output), output.state.plan(), links)  # the manifests one at a time


def refuse_links(output: Any, plan: Plan | None = None, *, writes: set[str] | None = None) -> None:
    """Before a command writes into a written dataset (finalize, validation, statistics, an ignore list, a T2I
    pack): a link where it writes is refused by name. ``writes``: the data files it writes (default: ``plan``'s,
    the output's own plan by default); its state, metadata and empty encodings are always among them."""
    links = output.links()
    if not links:
        return
    if writes is None:
        plan = plan if plan is not None else output.state.plan()
        writes = set(planned_files(plan)) if plan is not None else set()
    found = [link for link in links if in_the_way(link, writes)]
    if found:
        raise LinkInOutputError(link_message(output.local, found))


def listed(names: list[str] | tuple[str, ...], limit: int = SHOWN) -> str:
    """``a``, ``b`` and 3 more: the first ``limit`` names, then a count."""
    shown = ", ".join(f"`{name}`" for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["Ownership", "classify", "listed", "ownership", "planned_files", "refuse_links"]
