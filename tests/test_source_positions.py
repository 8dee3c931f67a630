"""A source listed once, a unit read without listing it again (issue #37): ``list_entries`` gives each id where its
sample lies, ``read(ids, at=...)`` reads only there and gives the same samples, byte for byte, as ``read(ids)``; a
file changed since planning still gives the named rejects it gave before; the unit path opens a source once per
process, not once per unit."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from diffprep.config import load_settings
from diffprep.output import as_output
from diffprep.phases.pipeline import run
from diffprep.sources import MetadataSource, WebDatasetSource, metadata_rows
from diffprep.sources.base import read_planned
from diffprep.tasks.encode import plan_of

SLICES = [(0, 7), (5, 19), (18, 30), (29, 30)]


def media_rows(folder: Path, count: int) -> list[dict]:
    """Rows naming real files (a repeated path, a row without one, a missing file, a non-text caption among them)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        name = f"img/{i:03d}.png"
        (folder / name).write_bytes(bytes([i]) * (40 + i))
        rows.append({"image": name, "caption": f"caption {i} \u2028 with a line separator"})
    rows[3]["image"] = rows[2]["image"]  # a repeated path: id img/002.png#4
    rows[6]["image"] = ""  # no path: id #7, missing_media
    rows[9]["image"] = "img/none.png"  # media_not_found
    rows[12]["caption"] = 12  # invalid_caption
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    lines.insert(5, "   ")  # a blank line is skipped
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8") + b"\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["image", "caption"], lineterminator="\r\n")
    writer.writeheader()
    for i, row in enumerate(rows):
        # A quoted caption spanning lines: a record is not a line.
        writer.writerow({**row, "caption": f"line one\nline two {i}" if i % 4 == 1 else row["caption"]})
    path.write_text(text.getvalue(), encoding="utf-8", newline="")


def plain(samples) -> list[tuple]:
    """Samples as comparable values (a reject is an exception: compared by its reason and detail)."""
    return [(replace(s, reject=None), s.reject and (s.reject.reason, s.reject.detail)) for s in samples]


def planned(source) -> list[tuple[str, object]]:
    """``list_entries`` under the ids a plan gives them: a metadata row naming a file an earlier row names is listed
    under the file's id, and named ``<id>#<row>`` by the plan (``Source.repeats``), as ``list_ids`` names it."""
    entries = list(source.list_entries())
    ids = list(source.list_ids())
    assert [sid for sid, _ in entries] == [sid.partition("#")[0] or sid for sid in ids]
    return [(sid, at) for sid, (_, at) in zip(ids, entries)]


def check_positions_read_as_ids(source) -> list[str]:
    entries = planned(source)
    ids = [source_id for source_id, _ in entries]
    for lo, hi in SLICES:
        by_id = list(source.read(ids[lo:hi]))
        by_position = list(source.read(ids[lo:hi], at=[at for _, at in entries[lo:hi]]))
        assert plain(by_position) == plain(by_id) and [s.source_id for s in by_id] == ids[lo:hi]
    return ids


@pytest.mark.parametrize("name", ["d.jsonl", "d.csv"])
def test_metadata_rows_read_at_their_offsets_are_the_rows_read_by_id(tmp_path: Path, name: str):
    rows = media_rows(tmp_path, 30)
    (write_jsonl if name.endswith(".jsonl") else write_csv)(tmp_path / name, rows)
    source = MetadataSource(str(tmp_path / name))
    indexed = MetadataSource.indexed
    entries = planned(source)
    # Read at the positions alone: no row is looked up by id (the file is not read whole).
    samples = list(source.read([i for i, _ in entries], at=[at for _, at in entries]))
    assert MetadataSource.indexed == indexed
    assert [s.source_id for s in samples][2:8] == ["img/002.png", "img/002.png#4", "img/004.png", "img/005.png",
                                                   "#7", "img/007.png"]
    assert {s.source_id: s.reject.reason for s in samples if s.reject} == {
        "#7": "missing_media", "img/none.png": "media_not_found",
        **({"img/012.png": "invalid_caption"} if name.endswith(".jsonl") else {})}
    assert samples[0].image == bytes([0]) * 40 and samples[29].image == bytes([29]) * 69
    assert check_positions_read_as_ids(source) == [i for i, _ in entries]

    # A unit's process opens it with the plan's description: the file is not read on opening, only at the rows.
    metadata_rows._LAYOUTS.clear()  # as in another process
    scanned = MetadataSource.scanned
    unit_side = MetadataSource(str(tmp_path / name), planned=source.describe())
    assert MetadataSource.scanned == scanned and unit_side.columns == ["image", "caption"]
    assert plain(unit_side.read([i for i, _ in entries], at=[at for _, at in entries])) == plain(samples)
    # A plan written before it recorded the columns: the file is checked on opening, as before.
    MetadataSource(str(tmp_path / name), planned={**source.describe(), "columns": None})
    assert MetadataSource.scanned == scanned + 1


def test_a_metadata_file_changed_after_planning_gives_the_rejects_it_gave_before(tmp_path: Path):
    rows = media_rows(tmp_path, 30)
    write_jsonl(tmp_path / "d.jsonl", rows)
    entries = planned(MetadataSource(str(tmp_path / "d.jsonl")))
    ids, at = [i for i, _ in entries], [a for _, a in entries]
    # After planning: a row removed (every offset after it moves), a caption made invalid, a path changed.
    del rows[1]
    rows[20]["caption"] = None
    rows[25]["image"] = "img/elsewhere.png"
    write_jsonl(tmp_path / "d.jsonl", rows)
    source = MetadataSource(str(tmp_path / "d.jsonl"))
    by_position = list(source.read(ids, at=at))
    assert plain(by_position) == plain(source.read(ids))
    reasons = {s.source_id: s.reject.reason for s in by_position if s.reject}
    assert reasons["img/001.png"] == "source_missing"
    assert reasons["img/021.png"] == "missing_caption"
    assert reasons["img/026.png"] == "source_missing"
    assert by_position[2].image == bytes([2]) * 42  # a row that moved is still found by its id


def write_shards(folder: Path, shards: int, keys: int) -> None:
    for t in range(shards):
        with tarfile.open(folder / f"s{t}.tar", "w") as tar:
            for k in range(keys):
                members = [("jpg", bytes([k]) * (600 + 37 * k)), ("txt", f"caption {t}/{k}".encode())]
                name = f"k{k:03d}" + ("-a-long-name" * 12 if k == 7 else "")  # over 100 bytes: a pax header
                for ext, data in members:
                    info = tarfile.TarInfo(f"{name}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def test_webdataset_members_read_at_their_spans_are_the_members_read_by_id(tmp_path: Path):
    write_shards(tmp_path, 3, 10)
    source = WebDatasetSource(str(tmp_path / "*.tar"))
    ids = check_positions_read_as_ids(source)
    assert len(ids) == 30 and ids[0] == "s0.tar/k000" and ids[29] == "s2.tar/k009"

    # A span is all a unit reads: with the headers before it broken, reading the whole shard stops there.
    entries = list(source.list_entries())
    wanted = [i for i in range(len(ids)) if ids[i].startswith("s1.tar/")][5:8]
    start = entries[wanted[0]][1][0]
    with open(tmp_path / "s1.tar", "r+b") as tar:
        tar.seek(start - 512 * 3)  # inside the member before: its header's successor is now garbage
        tar.write(b"\x01" * 512 * 3)
    by_id = list(source.read([ids[i] for i in wanted]))
    by_position = list(read_planned(source, [ids[i] for i in wanted], [entries[i][1] for i in wanted]))
    assert all(s.reject is None for s in by_position) and [s.caption for s in by_position] == [
        "caption 1/5", "caption 1/6", "caption 1/7"]
    assert all(s.reject is not None for s in by_id)

    # A shard rewritten since planning (other members at the spans): read whole, as without positions.
    write_shards(tmp_path, 2, 12)
    again = list(source.read(ids[:12], at=[at for _, at in entries[:12]]))
    assert plain(again) == plain(source.read(ids[:12])) and all(s.reject is None for s in again[:10])


def test_a_run_opens_its_metadata_source_once_for_all_its_units(tmp_path: Path):
    rows = [{"image": f"img/{i:03d}.png", "caption": f"caption {i}"} for i in range(40)]
    (tmp_path / "img").mkdir()
    for row in rows:  # a prompts run reads each media file (it must be there), never decodes it
        (tmp_path / row["image"]).write_bytes(b"")
    write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    settings = load_settings(overrides={
        "source": {"type": "metadata", "metadata_file": str(tmp_path / "d.jsonl")},
        "output": {"output_dir": str(out), "shard_size": 5}, "raw": {"prompts_only": True},
        "finalize": {"train_split": 1.0}})
    opened, indexed = MetadataSource.opened, MetadataSource.indexed
    result = run(settings, "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 40 and result.units == 8
    # The plan phase opens it, the sanity check and the 8 units share one: not one per unit.
    assert MetadataSource.opened - opened == 2
    # The plan kept each row's offset (list_entries) with its unit: the units read their rows there, and no
    # process built the index of every id.
    assert MetadataSource.indexed - indexed == 0
    assert all(unit.positions is not None and len(unit.positions) == 5 for unit in as_output(out).state.plan().units)

    # A unit task reads the plan once per process, and again only when plan.json is another file (a new plan).
    output = as_output(out)
    plan = plan_of(output)
    assert plan is not None and plan_of(output) is plan and plan_of(as_output(out)) is plan
    output.state.write_plan(plan)
    assert plan_of(output) is not plan and plan_of(output).fingerprint == plan.fingerprint


BUCKET = "positions"


@pytest.mark.usefixtures("aws_env")
def test_a_unit_reads_its_rows_of_a_metadata_file_in_a_bucket_by_ranged_gets(admin, proxy, tmp_path: Path):
    rows = media_rows(tmp_path, 30)
    write_jsonl(tmp_path / "d.jsonl", rows)
    for path in sorted(tmp_path.rglob("*")):
        if path.is_file():
            admin.put_object(Bucket=BUCKET, Key=f"m/{path.relative_to(tmp_path)}", Body=path.read_bytes())
    url = f"s3://{BUCKET}/m/d.jsonl"
    listed = MetadataSource(url, s3_endpoint_url=proxy.url)
    entries = planned(listed)
    ids, at = [i for i, _ in entries][10:20], [a for _, a in entries][10:20]
    proxy.reset()
    unit_side = MetadataSource(url, s3_endpoint_url=proxy.url, planned=listed.describe())
    samples = list(unit_side.read(ids, at=at))
    local = list(MetadataSource(str(tmp_path / "d.jsonl")).read(ids, at=at))
    assert [(s.source_id, s.image, s.caption, s.reject and s.reject.reason) for s in samples] == [
        (s.source_id, s.image, s.caption, s.reject and s.reject.reason) for s in local]
    assert samples[0].image == bytes([10]) * 50 and samples[2].reject.reason == "invalid_caption"
    gets = proxy.requests("GET", f"/{BUCKET}/m/d.jsonl")
    # Only ranged GETs of the file (one here: the unit's rows are a small part of it), never the whole of it.
    assert gets and all(r.headers.get("Range", r.headers.get("range", "")).startswith("bytes=") for r in gets)


@pytest.mark.usefixtures("aws_env")
def test_a_unit_reads_its_members_of_a_shard_in_a_bucket_by_ranged_gets(admin, proxy, tmp_path: Path):
    write_shards(tmp_path, 2, 10)
    for t in range(2):
        admin.put_object(Bucket=BUCKET, Key=f"w/s{t}.tar", Body=(tmp_path / f"s{t}.tar").read_bytes())
    source = WebDatasetSource(f"s3://{BUCKET}/w/*.tar", s3_endpoint_url=proxy.url)
    entries = list(source.list_entries())
    assert entries == list(WebDatasetSource(str(tmp_path / "*.tar")).list_entries())  # the same spans
    unit = entries[6:14]  # the end of one shard, the start of the next
    proxy.reset()
    samples = list(source.read([i for i, _ in unit], at=[at for _, at in unit]))
    gets = [r for r in proxy.log if r.method == "GET"]
    assert plain(samples) == plain(source.read([i for i, _ in unit]))
    assert [s.caption for s in samples] == [f"caption {t}/{k}" for t, k in [(0, 6), (0, 7), (0, 8), (0, 9), (1, 0),
                                                                            (1, 1), (1, 2), (1, 3)]]
    # Only ranged GETs, s0's from its 7th key's header on, not from its start.
    assert gets and all("Range" in r.headers for r in gets)
    assert gets[0].path == f"/{BUCKET}/w/s0.tar" and gets[0].headers["Range"].startswith(f"bytes={unit[0][1][0]}-")
