"""Long videos (``--split-scenes``): each source cut at its shots into many clips, planned once, read per window.

Plan phase (:func:`plan_clips`): every source the plan does not know yet is indexed, its shots found
(:func:`~diffprep.media.scenes.detect_shots`, sources on ``decode_workers`` threads) and its windows chosen
(:func:`~diffprep.media.windows.source_windows`); plan.json's ``scenes`` records, per source, its size, its
decoded frame count (and the container's), its shots, its windows and the frames no window takes, by why. A
re-run or an append reads them back instead of detecting again. The plan's ids are the windows' clip ids
(``<source>#<shot>:<first>-<last>``), each in the unit of its bucket; a source with no window (every shot
shorter than every bucket, or unreadable) keeps its own id, and the encode phase names why it gives nothing.

Encode phase (:func:`read_clips`, :func:`prepare_clip_window`): a unit's clip ids are read from the source one
source file per run of its windows, each window decoded alone (:mod:`diffprep.media.window_decode`). The
caption of every clip is its source's, or its shot's (or window's) in ``--scene-captions``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from diffprep import contract
from diffprep.run.approvals import ABORT, Question
from diffprep.errors import RejectError
from diffprep.media.audio import load_clip_audio
from diffprep.media.buckets import Bucket, parse_bucket
from diffprep.media.scenes import detect_shots
from diffprep.media.video import ClipSpec, PreparedClip, probe
from diffprep.media.window_decode import decode_window, timeline
from diffprep.media.windows import SceneSettings, Window, clip_id, parse_clip_id, shot_spans, source_windows
from diffprep.sources import Source, SourceSample

log = logging.getLogger(__name__)

CHUNK = 16  # sources read at a time while planning

__all__ = ["LongVideoPlan", "ShortShots", "changed_sources", "given_way", "confirm_discarded", "discard_question", "discarded_frames",
           "plan_clips", "plan_long_videos", "prepare_clip_window", "read_clips", "resplit_sources", "scene_record", "scenes_markdown",
           "scenes_summary", "scenes_table", "short_shots", "source_of"]


def scene_record(data: bytes, spec: ClipSpec) -> dict[str, Any]:
    """What plan.json keeps of one source: size, frame counts, shots, windows and discarded frames."""
    scene = spec.scenes
    info = probe(data)
    shots = detect_shots(data, scene.detector, scene.min_scene_seconds, info=info, threshold=scene.threshold)
    frames = timeline(info, spec.target_fps)
    on_timeline = timeline(info, spec.target_fps, shots.decoded_frames)
    spans = shot_spans(shots.shots, on_timeline)
    windows, discarded = source_windows(info.width, info.height, spans, spec.buckets, scene)
    if len(frames) > len(on_timeline):
        discarded["not_decoded"] = len(frames) - len(on_timeline)
    record = {"size": [info.width, info.height], **shots.to_json(), "timeline_frames": len(on_timeline),
              "windows": [[w.shot, w.first, w.last, str(w.bucket)] for w in windows], "discarded": discarded}
    shortest = min(b.frames for b in spec.buckets)
    short = [end - start for start, end in spans if 0 < end - start < shortest]
    if short:  # the frames of each shot shorter than every bucket: the bucket that keeps them (discard_question)
        record["short_shots"] = short
    return record


def _windows(record: dict[str, Any]) -> list[Window]:
    return [Window(shot, first, last, parse_bucket(bucket)) for shot, first, last, bucket in record.get("windows", ())]


def plan_clips(source: Source, ids: Sequence[str], spec: ClipSpec, known: dict[str, dict[str, Any]], *,
               workers: int) -> tuple[list[str], Callable[[str], str | None], dict[str, dict[str, Any]]]:
    """The plan's ids (clip ids, source order), the bucket of each, and the ``scenes`` records of every source
    in ``ids`` (``known``: the earlier plan's, kept as they are; only other sources are read)."""
    scene = spec.scenes
    records = {sid: known[sid] for sid in ids if sid in known}
    new = [sid for sid in ids if sid not in known]
    stamps = getattr(source, "stamps", None)  # a stat (or HEAD) per file: what it is now, without reading it
    changed = changed_sources(records, stamps(list(records)) if stamps and records else {})
    if changed:
        log.warning("%d planned sources changed since their shots were found; they keep their planned clips "
                    "(a clip no longer in the file is the reject window_out_of_range). To split them again, "
                    "write to a new output (--on-existing new-dir) or overwrite: %s", len(changed),
                    ", ".join(changed[:10]))
    now = stamps(new) if stamps and new else {}
    started = time.perf_counter()

    def record_of(sample: SourceSample) -> dict[str, Any]:
        if sample.reject is not None:
            return {"reject": {"reason": sample.reject.reason, "detail": sample.reject.detail}}
        if sample.video is None:
            return {"image": True}  # an image: a one-frame clip where an F = 1 bucket exists
        try:
            return scene_record(sample.video, spec)
        except RejectError as error:
            return {"reject": {"reason": error.reason, "detail": error.detail}}

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="diffprep-scenes") as pool:
        for first in range(0, len(new), CHUNK):
            chunk = list(new[first:first + CHUNK])
            records.update(zip(chunk, pool.map(record_of, source.read(chunk))))
    for sid in new:
        if sid in now:
            records[sid]["stamp"] = now[sid]
    if new:
        log.info("found the shots of %d sources in %.1f s", len(new), time.perf_counter() - started)
    for sid in new:
        record = records[sid]
        if "shots" in record:
            log.info("%s: %d frames, %d shots, %d clips; frames in no clip: %s", sid, record["timeline_frames"],
                     len(record["shots"]), len(record["windows"]),
                     ", ".join(f"{n} {why}" for why, n in sorted(record["discarded"].items())) or "none")
    planned: list[str] = []
    buckets: dict[str, str | None] = {}
    for sid in ids:
        windows = _windows(records[sid])
        if not windows:
            planned.append(sid)
            buckets[sid] = None
        for window in windows:
            planned.append(clip_id(sid, window))
            buckets[planned[-1]] = str(window.bucket)
    if scene.captions:  # a key that names no planned clip or shot: named, not silently dropped
        known = set(planned) | {cid.rsplit(":", 1)[0] for cid in planned if parse_clip_id(cid)}
        unused = [key for key, _ in scene.captions if key not in known]
        if unused:
            log.warning("--scene-captions: %d keys name no planned clip or shot (ids are <source id>#<shot> or "
                        "<source id>#<shot>:<first>-<last>, as plan.json's scenes list them): %s", len(unused),
                        ", ".join(unused[:10]))
    return planned, buckets.get, records


def changed_sources(records: dict[str, dict[str, Any]], now: dict[str, str]) -> list[str]:
    """The planned sources whose files' stamps differ from those recorded when their shots were found."""
    return [sid for sid, record in records.items()
            if "stamp" in record and sid in now and now[sid] != record["stamp"]]


def scenes_table(scenes: dict[str, dict[str, Any]], limit: int = 500) -> list[dict[str, Any]]:
    """One row per source (the first ``limit``) for the plan artifact: frames, shots, clips per bucket, frames in
    no clip by why, or the source's reject."""
    rows = []
    for sid, record in list(scenes.items())[:limit]:
        if "shots" not in record:
            reject = record.get("reject")
            rows.append({"source": sid, "frames": None, "shots": None, "clips": {},
                         "discarded": {}, "note": f"{reject['reason']}: {reject['detail']}" if reject else "image"})
            continue
        clips: dict[str, int] = {}
        for *_, bucket in record["windows"]:
            clips[bucket] = clips.get(bucket, 0) + 1
        rows.append({"source": sid, "frames": record["timeline_frames"], "shots": len(record["shots"]),
                     "clips": clips, "discarded": dict(record["discarded"]), "note": ""})
    return rows


def discarded_frames(scenes: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Frames no window takes over all sources, by why (``short_shot``, ``chain_tail``, ``not_sampled``...)."""
    total: dict[str, int] = {}
    for record in scenes.values():
        for reason, count in record.get("discarded", {}).items():
            total[reason] = total.get(reason, 0) + count
    return total


@dataclass(frozen=True)
class LongVideoPlan:
    """What fetch plans for a ``--split-scenes`` run: the clip ids and their buckets, the ``scenes`` records, the
    sources split again (fixed files whose every clip was rejected) and their earlier clip ids planned again."""

    ids: list[str]
    bucket_of: Callable[[str], str | None]
    records: dict[str, dict[str, Any]]
    resplit: list[str]
    retry: list[str]


def plan_long_videos(source: Source, spec: ClipSpec, previous: Any, manifests: dict[int, Any], *,
                     workers: int) -> LongVideoPlan:
    """The clips of every source (``previous``: the earlier plan of the same settings, or None): its sources keep
    their shots and windows, except those to split again (``resplit_sources``), which are planned as new ones."""
    resplit = resplit_sources(previous, manifests, getattr(source, "stamps", None)) if previous is not None else []
    known = {sid: r for sid, r in previous.scenes.items() if sid not in resplit} if previous is not None else {}
    ids, bucket_of, records = plan_clips(source, list(source.list_ids()), spec, known, workers=workers)
    retry: list[str] = []
    if resplit:
        before, split_again = {sid for unit in previous.units for sid in unit.source_ids}, set(resplit)
        retry = [cid for cid in ids if cid in before and source_of(cid) in split_again]
    return LongVideoPlan(ids, bucket_of, records, resplit, retry)


def given_way(previous: Any, new_units: Sequence[Any], resplit: Sequence[str], again: set[str]) -> dict[str, int]:
    """The earlier ids of the re-split sources that no new unit plans again -> the unit of their source's new
    clips: they give way to it, so the audit counts the new outcome only."""
    last = {source_of(sid): unit.unit for unit in new_units for sid in unit.source_ids}
    split_again = set(resplit)
    return {sid: last[source_of(sid)] for unit in previous.units for sid in unit.source_ids
            if source_of(sid) in split_again and source_of(sid) in last and sid not in again}


def source_of(planned_id: str) -> str:
    """The source id of a planned id: a clip id's source, else the id itself (a source the plan found no window in)."""
    parsed = parse_clip_id(planned_id)
    return parsed[0] if parsed else planned_id


def resplit_sources(previous: Any, manifests: dict[int, Any], stamps: Callable[[list[str]], dict[str, str]] | None
                    ) -> list[str]:
    """The planned sources to split again: every planned id of theirs is a reject of a committed unit (no clip of
    theirs was written), and their file changed since their shots were found (its stamp). A fixed file gets its
    clips; a source with a clip written, or one still to encode, keeps its plan (reported as changed)."""
    if stamps is None:
        return []
    rejected = {(unit, r.source_id) for unit, m in manifests.items() if m.fingerprint == previous.fingerprint
                for r in m.rejects if not previous.superseded(unit, r.source_id)}
    # Per source, its planned clips that are not such a reject (counted, not listed: a unit's list at a time).
    planned: dict[str, int] = {}
    for unit in previous.units:
        for planned_id in unit.source_ids:
            source = source_of(planned_id)
            planned[source] = planned.get(source, 0) + ((unit.unit, planned_id) not in rejected)
    candidates = {sid: record for sid, record in previous.scenes.items()
                  if "stamp" in record and planned.get(sid) == 0}
    if not candidates:
        return []
    return changed_sources(candidates, stamps(list(candidates)))


def scenes_summary(scenes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The plan of a long-video run in totals (the CLI's summary, the plan artifact's head): sources, those that gave
    no shots (unreadable), shots, frames on the timeline, clips per bucket, frames in no clip by why."""
    clips: dict[str, int] = {}
    shots = frames = unreadable = 0
    for record in scenes.values():
        if "shots" not in record:
            unreadable += "reject" in record
            continue
        shots += len(record["shots"])
        frames += record["timeline_frames"]
        for *_, bucket in record["windows"]:
            clips[bucket] = clips.get(bucket, 0) + 1
    return {"sources": len(scenes), "unreadable": unreadable, "shots": shots, "frames": frames,
            "clips": dict(sorted(clips.items())), "discarded": discarded_frames(scenes)}


def scenes_markdown(scenes: dict[str, dict[str, Any]], limit: int = 50) -> str:
    """The plan artifact of a long-video run, before any model is loaded: totals, clips and frames per bucket,
    frames in no clip by why, and the first ``limit`` sources (plan.json's ``scenes`` holds every one). Time and
    disk per bucket are projected from the sanity batch: its artifact follows."""
    summary = scenes_summary(scenes)
    lines = [f"**{summary['sources']} sources**, {summary['shots']} shots, {summary['frames']} frames on the "
             f"timeline, {sum(summary['clips'].values())} clips"
             + (f"; {summary['unreadable']} sources unreadable (rejected)" if summary["unreadable"] else ""),
             "", "| bucket | clips | frames in clips |", "|---|---:|---:|"]
    lines += [f"| {bucket} | {n} | {n * parse_bucket(bucket).frames} |" for bucket, n in summary["clips"].items()]
    if summary["discarded"]:
        lines += ["", "| frames in no clip | frames |", "|---|---:|"]
        lines += [f"| `{why}` | {n} |" for why, n in sorted(summary["discarded"].items())]
    lines += ["", "| source | frames | shots | clips per bucket | frames in no clip | note |",
              "|---|---:|---:|---|---|---|"]
    for row in scenes_table(scenes, limit):
        clips = ", ".join(f"{b}: {n}" for b, n in sorted(row["clips"].items()))
        discarded = ", ".join(f"{n} {why}" for why, n in sorted(row["discarded"].items()))
        lines.append(f"| `{row['source']}` | {row['frames'] if row['frames'] is not None else ''} | "
                     f"{row['shots'] if row['shots'] is not None else ''} | {clips} | {discarded} | "
                     f"{row['note'].replace('|', '/')} |")
    if len(scenes) > limit:
        lines.append(f"\n...and {len(scenes) - limit} more sources in `{contract.STATE_DIR}/{contract.PLAN_JSON}`")
    lines += ["", "Projected time and disk per bucket: the sanity check's artifact (measured on one batch)."]
    return "\n".join(lines)


@dataclass(frozen=True)
class ShortShots:
    """The frames of shots shorter than every bucket, the only frames a bucket could keep that the clip mode does
    not leave out by its own rule (a chain's tail, frames between sampled windows). ``rejected_ids`` and
    ``by_reason`` read like the audit's, so an encoding's ``rejects_advice`` names the bucket that keeps them."""

    frames: int  # frames in short shots, over every source
    total: int  # frames on the timeline, over every source
    rejected_ids: list[dict[str, str]]  # one per short shot: source id, too_few_frames, "a clip of N frames ..."
    digest: str  # sha256 of the sources and their short shots (an accept holds for exactly these)

    @property
    def fraction(self) -> float:
        return self.frames / self.total if self.total else 0.0

    @property
    def by_reason(self) -> dict[str, int]:
        return {"too_few_frames": len(self.rejected_ids)} if self.rejected_ids else {}


def short_shots(scenes: dict[str, dict[str, Any]]) -> ShortShots:
    """What :func:`confirm_discarded` asks about, from plan.json's ``scenes``."""
    rows = [{"source_id": sid, "reason": "too_few_frames",
             "detail": f"a clip of {n} frames (a shot) is shorter than every bucket"}
            for sid, record in scenes.items() for n in record.get("short_shots", ())]
    counted = {sid: record["discarded"]["short_shot"] for sid, record in scenes.items()
               if record.get("discarded", {}).get("short_shot")}
    digest = hashlib.sha256(json.dumps(sorted(counted.items())).encode()).hexdigest()
    return ShortShots(frames=sum(counted.values()),
                      total=sum(record.get("timeline_frames", 0) for record in scenes.values()),
                      rejected_ids=rows, digest=digest)


def discard_question(found: ShortShots, out_dir: str, advice: str = "") -> Question:
    """Whether to encode the long videos without the frames of their shots shorter than every bucket."""
    shown = found.rejected_ids[:50]
    lines = [f"**{found.frames} of {found.total} frames** ({found.fraction:.2%}) of the long videos lie in shots "
             "shorter than every bucket: no clip would take them.", "",
             "| source id | shot |", "|---|---|", *(f"| `{r['source_id']}` | {r['detail']} |" for r in shown)]
    if len(found.rejected_ids) > len(shown):
        lines.append(f"\n...and {len(found.rejected_ids) - len(shown)} more short shots in "
                     f"`{out_dir}/{contract.STATE_DIR}/{contract.PLAN_JSON}` (`scenes`)")
    if advice:
        lines += ["", advice]
    lines += ["", "**Choices:** `accept`: encode the clips the plan has, without these frames · `abort`: stop "
                  "before anything is encoded (the plan, with its shots, is kept)."]
    return Question(key="discarded-frames", title=f"{found.frames} frames of the long videos are in no clip",
                    description="\n".join(lines), choices=("accept", ABORT),
                    preset_hint=f"--accept-rejects {found.fraction:.4f} (flow parameter output.accept_rejects; "
                                "for long videos: a fraction of the frames, too)")


def confirm_discarded(scenes: dict[str, dict[str, Any]], output: Any, accept: float | None, ask: Callable[..., str],
                      advice: Callable[[ShortShots], str]) -> None:
    """Ask :func:`discard_question` before any model is loaded when the frames in short shots exceed ``accept`` (a
    fraction of the frames, as ``--accept-rejects`` is of the samples; None: any). An accept is kept in the state
    folder and holds for the same short shots; abort ends the run (the answer raises)."""
    found = short_shots(scenes)
    if not found.frames or (accept is not None and found.fraction <= accept):
        return
    recorded = output.state.read_json(contract.DISCARD_ANSWER_JSON)
    if recorded and recorded.get("answer") == "accept" and recorded.get("digest") == found.digest:
        log.info("%d frames in shots shorter than every bucket were accepted on %s: not asked again", found.frames,
                 recorded.get("answered_at"))
        return
    answer = ask(discard_question(found, output.uri, advice(found)))
    output.state.write_json(contract.DISCARD_ANSWER_JSON, {
        "answer": answer, "digest": found.digest, "frames": found.frames, "total": found.total,
        "answered_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def read_clips(source: Source, ids: Sequence[str], scenes: SceneSettings | None = None) -> Iterator[SourceSample]:
    """One sample per clip id of ``ids`` (source order), its ``source_id`` the clip id: each source file read
    once per run of consecutive windows of it; its caption the source's, or its shot's in ``scenes.captions``
    (``--scene-captions``)."""
    sources = [(parsed[0] if (parsed := parse_clip_id(cid)) else cid) for cid in ids]
    runs = [sid for i, sid in enumerate(sources) if i == 0 or sources[i - 1] != sid]
    read = iter(source.read(runs))
    current: SourceSample | None = None
    for i, (cid, sid) in enumerate(zip(ids, sources)):
        if i == 0 or sources[i - 1] != sid:
            current = next(read)
        caption = scenes.caption_of(cid) if scenes is not None else None
        if caption is not None and current.reject is None:
            yield replace(current, source_id=cid, caption=caption)
        else:
            yield replace(current, source_id=cid)


def prepare_clip_window(spec: ClipSpec, sample: SourceSample, bucket: str | None) -> PreparedClip:
    """A clip id's window decoded in its unit's ``bucket``; a source id the plan found no window in: its
    reject."""
    parsed = parse_clip_id(sample.source_id)
    if parsed is None:
        if sample.video is None:
            return spec.prepare(sample.media, video=False, bucket=parse_bucket(bucket) if bucket else None)
        probe(sample.video)  # an unreadable file: the decoder's own reject
        shortest = min(spec.buckets, key=lambda b: b.frames)
        raise RejectError("too_few_frames", f"every shot of this clip is shorter than every bucket; the shortest is "
                          f"{shortest} ({shortest.frames} frames); plan.json's scenes list its shots")
    source_id, shot, first, last = parsed
    if bucket is None:
        raise RejectError("window_frames_mismatch", "the plan gives this window no bucket")
    if sample.video is None:
        raise RejectError("unexpected_image", "the plan holds windows of a clip, the source gives an image now")
    target = Bucket(*map(int, bucket.split("x")))
    pixels, meta = decode_window(sample.video, target, first, last, target_fps=spec.target_fps,
                                 max_pixels=spec.max_pixels)
    meta = {"source": source_id, "shot": shot, **meta}
    track = None
    if spec.audio:  # LTX-2: the source's sound from the window's first frame, for the window's F / fps seconds
        if not meta["fps"]:
            raise RejectError("audio_decode_error", "the clip has no frame rate, so the audio to keep is unknown")
        track = load_clip_audio(io.BytesIO(bytes(sample.video)), start=meta["frame_times"][0],
                                duration=target.frames / meta["fps"])
        meta["audio"] = {"sample_rate": track.sample_rate, "source_channels": track.source_channels,
                         "duration": track.duration, "start": meta["frame_times"][0]}
    return PreparedClip(pixels=pixels, bucket=target, info=None, meta=meta, audio=track)
