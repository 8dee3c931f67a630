"""Phase 1, fetch: resolve the source and what writes the samples, fingerprint the settings, plan the units.

The encoders are resolved (downloaded where needed: only the subfolders the
encoders use) but not loaded; their configs give the shapes every sample must
have (``diffprep.encodings``: each encoding says what it fingerprints and
expects). The output is only read here (an earlier plan of the same
fingerprint is extended, for appends); the plan is written by the pipeline
once the verify phase decided where it may go.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from diffprep import contract
from diffprep.config import Settings, stretch_note
from diffprep.families.hub import resolve_token
from diffprep.encodings import encoding_for, get_encoding
from diffprep.errors import SourceError
from diffprep.output import Output, as_output
from diffprep.encodings.clips import planned_spec
from diffprep.run.long_videos import given_way, plan_long_videos
from diffprep.media.windows import SceneSettings
from diffprep.writer.plan import Plan, fingerprint, plan_units
from diffprep.sources import Source, open_source
from diffprep.sources.stamps import describe_stamp, source_stamp
from diffprep.sources.labels import check_num_classes
from diffprep.run.threads import record

log = logging.getLogger(__name__)


def fetch(
    settings: Settings,
    output: Output | str | os.PathLike | None = None,
    *,
    token: str | None = None,
    encoding: str = contract.ENCODING_PREENCODED,
) -> tuple[Plan, Source]:
    """Resolve everything and plan the units. Reads ``output`` (default: the settings') but writes nothing there.

    ``token``: a Hugging Face token; by default the token file, ``HF_TOKEN`` or the cached login.
    ``encoding``: the kind of dataset (``diffprep.encodings``): ``raw`` resolves no encoder.
    """
    output = as_output(output if output is not None else settings.output.output_dir)
    token = token or resolve_token(settings.auth.hf_token_file)
    encoding = encoding_for(settings, encoding, token)
    byte, expected = get_encoding(encoding).planned(settings, token)
    fp = fingerprint(byte)
    previous = output.state.plan() if output.local.is_dir() else None
    if previous is not None and previous.fingerprint != fp:
        previous = None  # other settings: verify-existing will ask what to do
    scenes = SceneSettings.from_json(byte.get("video", {}).get("scenes"))
    # Taken before the listing (a file changed while it is listed is listed again next time); long videos have
    # more than their source's files in their plan (shots found in the clips), so they list as before.
    stamp = None if scenes is not None else source_stamp(settings.source, shard_size=settings.output.shard_size,
                                                         max_samples=settings.output.max_samples)
    unchanged = previous is not None and stamp is not None and previous.source_stamp == stamp
    options = get_encoding(encoding).source_options(byte)
    if unchanged:  # the columns the listing found: opening reads nothing of the file (``metadata_rows``)
        options = {"planned": previous.source, **options}
    source = open_source(settings.source, token=token, **options)
    check_num_classes(settings.source.num_classes, source.describe())  # once, before anything is planned
    # Long videos: retried rejects are whole sources, re-split as new ones (below; clip ids have no stamps).
    recorded = Recorded.of(output, previous, source) if previous is not None else Recorded()
    retry = changed_rejects(recorded, source) if scenes is None else []
    long = None
    if scenes is not None:
        long = plan_long_videos(source, planned_spec(byte), previous,
                                output.state.manifests() if previous is not None else {},
                                workers=settings.image.decode_workers)
        ids, bucket_of, retry, buckets_of = long.ids, long.bucket_of, long.retry, None
    if unchanged and not retry:
        # Nothing can be new: the listing would find the plan's own ids (and their missing ones) again.
        log.info("listing of the source skipped: source unchanged since it was planned: %s", describe_stamp(stamp))
        units, missing, missing_count = list(previous.units), list(previous.missing), previous.missing_count
    else:
        if long is None:
            ids, bucket_of, buckets_of = listing(source), None, _bucketed(settings, encoding, source, byte)
        units, missing, missing_count = plan_units(
            ids,
            shard_size=settings.output.shard_size,
            max_samples=settings.output.max_samples,
            previous=previous,
            bucket_of=bucket_of,
            retry=retry,
            buckets_of=buckets_of,
            repeats=getattr(source, "repeats", None),
        )
    retried = dict(previous.retried) if previous is not None else {}
    first_new = len(previous.units) if previous is not None else 0
    again = set(retry)
    if again:  # the new units' lists, streamed (none kept in memory) only when something was retried
        retried |= {sid: unit.unit for unit in units[first_new:] for sid, _ in unit.entries() if sid in again}
    gone: dict[str, int] = {}
    if long is not None and long.resplit:
        gone = given_way(previous, units[first_new:], long.resplit, again)
        retried |= gone
        missing = [sid for sid in missing if sid not in gone]
        missing_count -= len(gone)
        log.info("split %d sources again whose files changed since every clip of theirs was rejected: %s",
                 len(long.resplit), ", ".join(long.resplit[:10]))
    if not units:
        raise SourceError(f"the source holds no samples: {json.dumps(source.describe())}")
    plan = Plan(
        fingerprint=fp,
        settings=byte,
        source=source.describe(),
        expected=expected,
        units=units,
        encoding=encoding,
        missing=missing,
        missing_count=missing_count,
        retried=retried,
        retrying=len(retry) + len(gone),
        scenes=long.records if long is not None else {},
        changed_units=changed_inputs(recorded, source),
        # The planned bits' CPU facts: a resume or an append keeps the first run's (diffprep/run/threads.py).
        cpu=previous.cpu if previous is not None and previous.cpu else record(settings.workers.encoder_threads).to_json(),
        source_stamp=stamp,
    )
    if note := stretch_note(settings):
        log.warning("%s", note)
    if plan.changed_units:
        log.warning("%d written units hold samples whose input files (a mask, a sound file, the clip) changed since "
                    "they were read; they are encoded again: units %s", len(plan.changed_units),
                    ", ".join(f"{u:06d}" for u in plan.changed_units[:10]))
    return plan, source


@dataclass
class Recorded:
    """What the committed manifests of a previous plan recorded of their inputs, read in one pass over them, one
    manifest at a time: the stamps of its rejects (the latest outcome of each id only) and of the written samples'
    input files (runs whose clips have other inputs). Nothing else of a manifest is kept."""

    rejects: dict[str, str] = field(default_factory=dict)  # source id -> its stamp when it was rejected
    inputs: dict[int, dict[str, str]] = field(default_factory=dict)  # unit -> its samples' stamps

    @classmethod
    def of(cls, output: Output, previous: Plan, source: Source) -> "Recorded":
        recorded = cls()
        if getattr(source, "stamps", None) is None:
            return recorded  # a source that stamps nothing: nothing to compare, no manifest read
        for unit, manifest in output.state.manifests().items():  # in unit order
            if manifest.fingerprint != previous.fingerprint:
                continue
            for reject in manifest.rejects:
                if reject.stamp is not None and not previous.superseded(unit, reject.source_id):
                    recorded.rejects[reject.source_id] = reject.stamp
            if manifest.stamps:
                recorded.inputs[unit] = manifest.stamps
        return recorded


def changed_rejects(recorded: Recorded, source: Source) -> list[str]:
    """The rejected samples of the previous plan whose input files changed or appeared since (their stamps differ),
    in plan order: only rejects the source stamped. Costs one stamp (a stat or HEAD per file) per such reject, none
    per sample."""
    stamps = getattr(source, "stamps", None)
    if stamps is None or not recorded.rejects:
        return []
    now = stamps(list(recorded.rejects))
    # A sample whose own file is gone is not retried: the plan reports it missing from the source.
    return [sid for sid, stamp in recorded.rejects.items()
            if now.get(sid, stamp) != stamp and not now[sid].startswith("-")]


def changed_inputs(recorded: Recorded, source: Source) -> list[int]:
    """The committed units of the previous plan holding a written sample whose input files (its clip, caption, a
    mask, a sound file: the source's stamp of its row) changed since it was read: their manifests' ``stamps``, kept
    by runs whose clips have other inputs (plan.planned_inputs). One stamp per such sample; none in other runs."""
    stamps = getattr(source, "stamps", None)
    if stamps is None or not recorded.inputs:
        return []
    now = stamps([sid for unit_stamps in recorded.inputs.values() for sid in unit_stamps])
    # A sample whose own file is gone is left as it is: the plan reports it missing from the source.

    def changed(sid: str, stamp: str) -> bool:
        return now.get(sid, stamp) != stamp and not now[sid].startswith("-")

    return sorted(unit for unit, unit_stamps in recorded.inputs.items()
                  if any(changed(sid, stamp) for sid, stamp in unit_stamps.items()))


def listing(source: Source) -> Iterable[str | tuple[str, object]]:
    """The source's listing, read once: ``(id, at)`` pairs where the source gives each sample's locator
    (``list_entries``: its unit then reads it without listing the source again), else its ids."""
    list_entries = getattr(source, "list_entries", None)
    return list_entries() if list_entries is not None else source.list_ids()


def _bucketed(settings: Settings, encoding: str, source: Source, byte: dict
              ) -> Callable[[list[str]], dict[str, str | None]] | None:
    """For a bucketing encoding (images in buckets, video, audio): the bucket of each of a batch of new ids, from
    their headers (``plan_units`` asks a chunk at a time, so no listing is held); None for the others."""
    if not get_encoding(encoding).bucketed(byte):
        return None
    return lambda ids: get_encoding(encoding).probe_buckets(settings, source, ids, byte)
