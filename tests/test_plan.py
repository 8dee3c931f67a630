"""The plan: units cut from the source listing, appends that keep old units, the fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.writer.plan import MISSING_PREVIEW, Plan, UnitPlan, fingerprint, plan_path, plan_units, read_plan, write_plan

BUCKET = "diffprep-plan"  # created by the admin fixture (conftest.py), for the bucket output's test


def ids(n: int, prefix: str = "s") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def as_pairs(units: list[UnitPlan]) -> list[tuple[int, list[str]]]:
    return [(u.unit, u.source_ids) for u in units]


def make_plan(units: list[UnitPlan], **fields) -> Plan:
    values = dict(
        fingerprint=fingerprint({"shard_size": 4}),
        settings={"shard_size": 4},
        source={"type": "directory", "input_dir": "/data"},
        expected={"latents": [16, 4, 4], "prompt_embeds": [16, 32], "pooled_prompt_embeds": [32], "dtype": "float32"},
        units=units,
    )
    values.update(fields)
    return Plan(**values)


# Cutting the listing into units


def test_units_are_chunks_of_shard_size_in_listing_order() -> None:
    units, missing, missing_count = plan_units(ids(10), shard_size=4)
    assert as_pairs(units) == [
        (0, ["s000", "s001", "s002", "s003"]),
        (1, ["s004", "s005", "s006", "s007"]),
        (2, ["s008", "s009"]),
    ]
    assert (missing, missing_count) == ([], 0)
    assert [u.shard for u in units] == ["000000.tar", "000001.tar", "000002.tar"]


def test_exact_multiple_has_no_empty_unit() -> None:
    units, _, _ = plan_units(ids(8), shard_size=4)
    assert [len(u.source_ids) for u in units] == [4, 4]


def test_empty_listing_gives_no_units() -> None:
    assert plan_units([], shard_size=4) == ([], [], 0)


def test_max_samples_stops_the_listing() -> None:
    consumed: list[str] = []

    def listing():
        for sid in ids(100):
            consumed.append(sid)
            yield sid

    units, _, _ = plan_units(listing(), shard_size=4, max_samples=6)
    assert as_pairs(units) == [(0, ids(4)), (1, ["s004", "s005"])]
    assert len(consumed) == 7  # stops right after the limit, not at the end of a large source


def test_duplicate_id_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"listed the sample id 's001' twice"):
        plan_units(["s000", "s001", "s002", "s001"], shard_size=4)


@pytest.mark.parametrize("spilled", [False, True])
def test_repeated_ids_are_named_by_the_source_and_an_append_knows_them(tmp_path: Path, monkeypatch,
                                                                        spilled: bool) -> None:
    """A metadata file's rows naming one file twice: the listing gives the file's id again, the plan names the repeat
    (``Source.repeats``: ``id#row``) without a set of every id; an append (more rows, the same file named again)
    plans only the new rows, whichever part of the index their names fall in. Against the source itself: its
    ``list_ids`` (a set of the paths seen) gives the same ids. ``spilled``: the index in 4 parts on disk."""
    from diffprep.sources.metadata import MetadataSource
    from diffprep.writer.unit_lists import ListingIndex

    if spilled:
        monkeypatch.setattr(ListingIndex, "PARTS", 4)
        monkeypatch.setattr(ListingIndex, "SPILL", 3)

    (tmp_path / "a.png").write_bytes(b"")
    rows = ["a.png", "b.png", "a.png", "", "c.png", "a.png"]
    metadata = tmp_path / "rows.jsonl"

    def write(count: int) -> MetadataSource:
        metadata.write_text("".join(json.dumps({"image": rows[i % len(rows)], "caption": str(i)}) + "\n"
                                    for i in range(count)))
        return MetadataSource(str(metadata))

    source = write(6)
    first, _, _ = plan_units(source.list_entries(), shard_size=4, repeats=source.repeats)
    assert [sid for u in first for sid in u.source_ids] == list(source.list_ids()) == [
        "a.png", "b.png", "a.png#3", "#4", "c.png", "a.png#6"]
    grown = write(9)
    units, missing, _ = plan_units(grown.list_entries(), shard_size=4, previous=make_plan(first),
                                   repeats=grown.repeats)
    assert as_pairs(units)[:2] == as_pairs(first) and missing == []
    assert as_pairs(units)[2:] == [(2, ["a.png#7", "b.png#8", "a.png#9"])] == [(2, list(grown.list_ids())[6:])]
    with pytest.raises(ValueError, match="twice"):  # without the source's naming, a repeat is an error
        plan_units(grown.list_entries(), shard_size=4)


# Appends


def test_append_keeps_previous_units_and_plans_new_ids_only() -> None:
    first, _, _ = plan_units(ids(6), shard_size=4)
    previous = make_plan(first)
    before = json.dumps(previous.to_json(), sort_keys=True)

    units, missing, missing_count = plan_units(ids(11), shard_size=4, previous=previous)

    # The partly filled unit 1 stays as it was: its shard may already be written.
    assert as_pairs(units) == [
        (0, ["s000", "s001", "s002", "s003"]),
        (1, ["s004", "s005"]),
        (2, ["s006", "s007", "s008", "s009"]),
        (3, ["s010"]),
    ]
    assert [u.to_json() for u in units[:2]] == [u.to_json() for u in first] and units[:2] == first
    assert (missing, missing_count) == ([], 0)
    assert json.dumps(previous.to_json(), sort_keys=True) == before  # the previous plan is not modified


def test_append_with_new_ids_sorting_before_old_ones() -> None:
    first, _, _ = plan_units(["m1", "m2", "m3"], shard_size=2)
    units, _, _ = plan_units(["a1", "a2", "m1", "m2", "m3", "z1"], shard_size=2, previous=make_plan(first))
    assert as_pairs(units) == [(0, ["m1", "m2"]), (1, ["m3"]), (2, ["a1", "a2"]), (3, ["z1"])]


def test_append_with_nothing_new_changes_nothing() -> None:
    first, _, _ = plan_units(ids(5), shard_size=2)
    units, _, _ = plan_units(ids(5), shard_size=2, previous=make_plan(first))
    assert as_pairs(units) == as_pairs(first)


def test_ids_gone_from_the_source_are_reported_not_removed() -> None:
    first, _, _ = plan_units(ids(6), shard_size=4)
    shrunk = [sid for sid in ids(8) if sid not in ("s001", "s004")]
    units, missing, missing_count = plan_units(shrunk, shard_size=4, previous=make_plan(first))
    assert as_pairs(units)[:2] == as_pairs(first)
    assert as_pairs(units)[2:] == [(2, ["s006", "s007"])]
    assert (missing, missing_count) == (["s001", "s004"], 2)


def test_missing_preview_is_capped_and_count_is_exact() -> None:
    first, _, _ = plan_units(ids(MISSING_PREVIEW + 5), shard_size=8)
    units, missing, missing_count = plan_units([], shard_size=8, previous=make_plan(first))
    assert as_pairs(units) == as_pairs(first)
    assert missing == ids(MISSING_PREVIEW)
    assert missing_count == MISSING_PREVIEW + 5


def test_max_samples_counts_previous_units_and_still_finds_missing_ids() -> None:
    first, _, _ = plan_units(ids(4), shard_size=4)
    listing = [sid for sid in ids(10) if sid != "s002"]
    units, missing, missing_count = plan_units(listing, shard_size=4, max_samples=6, previous=make_plan(first))
    assert as_pairs(units) == [(0, ids(4)), (1, ["s004", "s005"])]
    assert (missing, missing_count) == (["s002"], 1)


def test_duplicate_of_a_new_id_in_an_append_is_an_error() -> None:
    first, _, _ = plan_units(ids(2), shard_size=4)
    with pytest.raises(ValueError, match=r"'n1' twice"):
        plan_units(["s000", "s001", "n1", "n1"], shard_size=4, previous=make_plan(first))


# Fingerprint


def test_fingerprint_is_stable_and_independent_of_key_order() -> None:
    a = {"shard_size": 4, "image": {"image_size": 32, "center_crop": True}, "encoders": {"dtype": "float32"}}
    b = {"encoders": {"dtype": "float32"}, "image": {"center_crop": True, "image_size": 32}, "shard_size": 4}
    assert fingerprint(a) == fingerprint(b)
    assert len(fingerprint(a)) == 16
    assert all(c in "0123456789abcdef" for c in fingerprint(a))
    # A fixed value: the fingerprint of an existing output must not change between versions of this code.
    assert fingerprint({"a": 1}) == "015abd7f5cc57a2d"


def test_fingerprint_changes_with_any_value() -> None:
    base = {"shard_size": 4, "image": {"image_size": 32}}
    assert fingerprint(base) != fingerprint({"shard_size": 4, "image": {"image_size": 64}})
    assert fingerprint(base) != fingerprint({"shard_size": 5, "image": {"image_size": 32}})


# plan.json


def test_plan_round_trip_through_plan_json(tmp_path: Path) -> None:
    units, missing, missing_count = plan_units(ids(6), shard_size=4)
    plan = make_plan(units, missing=missing, missing_count=missing_count)
    out = tmp_path / "out"
    out.mkdir()

    path = write_plan(out, plan)

    assert path == out / contract.STATE_DIR / contract.PLAN_JSON == plan_path(out)
    assert read_plan(out) == plan
    assert read_plan(path) == plan
    loaded = read_plan(out)
    assert isinstance(loaded.units[0], UnitPlan)
    assert loaded.unit(1).source_ids == ["s004", "s005"]
    assert loaded.total_samples == 6
    assert json.loads(path.read_text())["version"] == contract.CONTRACT_VERSION


def test_write_plan_to_a_json_file_and_to_a_new_output_dir(tmp_path: Path) -> None:
    plan = make_plan([UnitPlan(0, ["a"])])
    staged = write_plan(tmp_path / "staging" / "plan-x.json", plan)
    assert staged == tmp_path / "staging" / "plan-x.json"
    assert read_plan(staged) == plan
    new_out = write_plan(tmp_path / "not-yet", plan)
    assert new_out == tmp_path / "not-yet" / contract.STATE_DIR / contract.PLAN_JSON
    assert read_plan(tmp_path / "not-yet") == plan


def test_read_plan_of_an_output_without_one(tmp_path: Path) -> None:
    assert read_plan(tmp_path) is None
    assert read_plan(tmp_path / "absent") is None


def test_unit_lookup_error_names_the_unit() -> None:
    plan = make_plan([UnitPlan(0, ["a"]), UnitPlan(1, ["b"])])
    assert plan.unit(1).source_ids == ["b"]
    with pytest.raises(KeyError, match="unit 7 is not in the plan"):
        plan.unit(7)


# Through the fetch phase: the plan found in the output is extended, never rebuilt


def test_fetch_extends_the_plan_of_a_grown_source(
    tmp_path: Path, demo_data: Path, tiny_model: Path, settings_for
) -> None:
    from diffprep.phases.fetch import fetch

    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"shard_size": 5})
    first, _ = fetch(settings)
    assert [len(u.source_ids) for u in first.units] == [5, 5, 2]
    write_plan(out, first)
    # The source grows: one id sorts before every old one, one after; one old sample disappears.
    images, captions = demo_data / "images", demo_data / "captions"
    for stem in ("00000a", "zzz"):
        (images / f"{stem}.png").write_bytes((images / "00001.png").read_bytes())
        (captions / f"{stem}.txt").write_text("a new sample")
    (images / "00004.png").unlink()
    (captions / "00004.txt").unlink()

    second, _ = fetch(settings)

    assert second.fingerprint == first.fingerprint
    assert as_pairs(second.units[:3]) == as_pairs(first.units)
    assert as_pairs(second.units[3:]) == [(3, ["00000a.png", "zzz.png"])]
    assert (second.missing, second.missing_count) == (["00004.png"], 1)

    # Other byte-affecting settings: the old plan is not extended (verify-existing will ask).
    other, _ = fetch(settings_for(out, demo_data, tiny_model, output={"shard_size": 5}, image={"image_size": 64}))
    assert other.fingerprint != first.fingerprint
    assert other.units[0].source_ids[:2] == ["00000.jpg", "00000a.png"]
    assert other.missing_count == 0


@pytest.mark.parametrize(
    ("section", "values", "changes"),
    [
        ("model", {"batch_size": 2}, False),
        ("model", {"text_cache_mib": 0}, False),  # the caption cache writes the same bytes
        ("image", {"decode_workers": 2}, False),
        ("output", {"max_samples": 3}, False),
        ("image", {"image_size": 64}, True),
        ("image", {"center_crop": False}, True),
        ("model", {"t5_max_length": 8}, True),
        ("model", {"precision": "bf16"}, True),
        ("model", {"latent_mode": "mode"}, True),
        ("output", {"shard_size": 3}, True),
    ],
)
def test_fingerprint_covers_the_byte_affecting_settings(
    tmp_path: Path, demo_data: Path, tiny_model: Path, settings_for, section: str, values: dict, changes: bool
) -> None:
    from diffprep.phases.fetch import fetch

    base, _ = fetch(settings_for(tmp_path / "out", demo_data, tiny_model))
    changed, _ = fetch(settings_for(tmp_path / "out", demo_data, tiny_model, **{section: values}))
    assert (changed.fingerprint != base.fingerprint) is changes


def test_fingerprint_counts_the_class_names_not_their_file(tmp_path: Path, demo_data: Path, tiny_model: Path,
                                                          settings_for) -> None:
    import datasets
    from PIL import Image

    from diffprep.phases.fetch import fetch

    data = tmp_path / "labels"
    rows = {"image": [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(3)], "label": [0, 1, 0]}
    datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64")})).save_to_disk(str(data))
    first, moved = tmp_path / "names.txt", tmp_path / "elsewhere.txt"
    first.write_text("tench\ngoldfish\n")
    moved.write_text("tench\n\ngoldfish\n")  # the same names (a blank line is no name)

    def planned(names: Path, **source):
        source = {"type": "huggingface", "hf_dataset": str(data), "input_dir": None, "caption_key": "label",
                  "class_names": str(names),
                  **source}
        return fetch(settings_for(tmp_path / "out", data, tiny_model, source=source))[0]

    base = planned(first)
    assert set(base.settings["captions"]) == {"class_names_sha256"}
    assert planned(moved).fingerprint == base.fingerprint  # another path, the same names
    assert planned(first, caption_template="a photo of a {label}").fingerprint != base.fingerprint
    first.write_text("tench\ngoldfish (renamed)\n")  # the file edited in place: other captions, other bytes
    assert planned(first).fingerprint != base.fingerprint
    # Without class names or a template the plan holds no "captions" entry: other fingerprints stay as they were.
    assert "captions" not in fetch(settings_for(tmp_path / "out2", demo_data, tiny_model))[0].settings


def test_retried_rejects_go_to_new_units_and_old_units_stay() -> None:
    first, _, _ = plan_units(ids(6), shard_size=4)
    previous = make_plan(first)
    units, missing, _ = plan_units(ids(7), shard_size=4, previous=previous, retry=["s001", "s005"])
    assert as_pairs(units) == [
        (0, ["s000", "s001", "s002", "s003"]),
        (1, ["s004", "s005"]),
        (2, ["s001", "s005", "s006"]),  # the retried ids first, then the new ones
    ]
    assert missing == []
    assert "retried" not in previous.to_json()  # plans that never retried keep their plan.json
    retried = make_plan(units, retried={"s001": 2, "s005": 2}, retrying=2)
    again = Plan.from_json(json.loads(json.dumps(retried.to_json())))
    assert again.retried == {"s001": 2, "s005": 2} and again.superseded(0, "s001") and not again.superseded(2, "s001")


# Each unit's sample list in a file of its own (issue 37): plan.json holds units, not samples


def test_plan_json_holds_units_and_each_list_its_samples_with_their_locators(tmp_path: Path) -> None:
    listing = [(f"row{i}", {"offset": 10 * i}) for i in range(5)] + [("odd \"name\" é", [3, 512])]
    units, _, _ = plan_units(listing, shard_size=4)
    path = write_plan(tmp_path / "out", make_plan(units))

    data = json.loads(path.read_text())
    assert data["units"] == [{"unit": 0, "count": 4, "file": "plan_units/000000.jsonl"},
                             {"unit": 1, "count": 2, "file": "plan_units/000001.jsonl"}]
    assert "row0" not in path.read_text()
    assert (path.parent / "plan_units" / "000001.jsonl").read_text(encoding="utf-8") == (
        '["row4",{"offset":40}]\n["odd \\"name\\" \\u00e9",[3,512]]\n')
    loaded = read_plan(tmp_path / "out")
    assert loaded.total_samples == 6 and [u.count for u in loaded.units] == [4, 2]
    assert loaded.units[1].source_ids == ["row4", "odd \"name\" é"]
    assert loaded.units[1].positions == [{"offset": 40}, [3, 512]]
    assert loaded == make_plan(units)
    # A source that gives no locators (list_ids): no positions, and each line is the id alone.
    plain, _, _ = plan_units(["a", "b"], shard_size=4)
    assert plain[0].positions is None and list(plain[0].entries()) == [("a", None), ("b", None)]


def test_a_process_going_through_every_unit_keeps_a_few_lists_not_every_id(tmp_path: Path) -> None:
    """The units phase and the audit read every unit's list once in one process: at 1M samples, keeping each list
    held every id (312 MiB in the units phase of benchmarks/scale.py). Only the last KEPT_LISTS stay."""
    from diffprep.writer import plan as plan_module

    units, _, _ = plan_units([f"s{i:04d}" for i in range(40)], shard_size=2)
    write_plan(tmp_path / "out", make_plan(units))
    loaded = read_plan(tmp_path / "out")
    for unit in loaded.units:
        assert unit.source_ids == [f"s{2 * unit.unit:04d}", f"s{2 * unit.unit + 1:04d}"]
    kept = [u.unit for u in loaded.units if u._ids is not None]
    assert kept == list(range(20 - plan_module.KEPT_LISTS, 20))
    assert loaded.units[0].count == 2 and loaded.units[0].source_ids == ["s0000", "s0001"]  # read again when used


def test_a_unit_list_is_written_as_the_unit_fills(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written: dict[str, list[str]] = {}

    def bucket_of(sid: str) -> None:  # called as each new id is planned, in listing order
        written[sid] = sorted(p.name for p in tmp_path.glob("diffprep-plan-*/plan_units/*.jsonl"))

    units, _, _ = plan_units(ids(12), shard_size=4, bucket_of=bucket_of)
    assert written["s008"] == ["000000.jsonl", "000001.jsonl"]  # the two full units, before the third is planned
    assert [u.count for u in units] == [4, 4, 4]
    del units
    assert not list(tmp_path.glob("diffprep-plan-*"))  # the staging folder goes with the last unit planned into it


def test_planning_with_the_ids_spilled_to_parts_on_disk(monkeypatch) -> None:
    """Dedup, appends, missing ids and the limit, with the ids written to 4 parts every 3 ids (256 and 200k in a
    run) and each part checked alone."""
    from diffprep.writer import plan as plan_module
    from diffprep.writer.unit_lists import ListingIndex

    monkeypatch.setattr(ListingIndex, "PARTS", 4)
    monkeypatch.setattr(ListingIndex, "SPILL", 3)
    monkeypatch.setattr(plan_module, "LISTING_CHUNK", 2)
    with pytest.raises(ValueError, match=r"'s001' twice"):
        plan_units(["s000", "s001", "s002", "s003", "s004", "s001"], shard_size=4)
    with pytest.raises(ValueError, match=r"'s005' twice"):
        plan_units(["s005", "s005"], shard_size=4)
    first, _, _ = plan_units(ids(6), shard_size=4)
    listing = [sid for sid in ids(11) if sid not in ("s001", "s004")] + ["s000"]  # a planned id listed twice: fine
    units, missing, missing_count = plan_units(listing, shard_size=4, previous=make_plan(first), retry=["s003"])
    assert as_pairs(units) == [(0, ids(4)), (1, ["s004", "s005"]), (2, ["s003", "s006", "s007", "s008"]),
                               (3, ["s009", "s010"])]
    assert (missing, missing_count) == (["s001", "s004"], 2)
    limited, _, _ = plan_units(ids(20), shard_size=4, max_samples=9, previous=make_plan(first))
    assert sum(u.count for u in limited) == 9


def test_a_resume_writes_only_the_lists_of_new_units(tmp_path: Path) -> None:
    from diffprep.output import Output

    output = Output(tmp_path / "out")
    first, _, _ = plan_units(ids(6), shard_size=4)
    output.state.write_plan(make_plan(first))
    lists = output.state.root / contract.PLAN_UNITS_DIR
    before = {p.name: p.stat().st_ino for p in lists.iterdir()}

    previous = output.state.plan()
    units, _, _ = plan_units(ids(9), shard_size=4, previous=previous)
    output.state.write_plan(make_plan(units))

    after = {p.name: p.stat().st_ino for p in lists.iterdir()}
    assert {name: after[name] for name in before} == before  # not rewritten
    assert sorted(after) == ["000000.jsonl", "000001.jsonl", "000002.jsonl"]
    assert as_pairs(output.state.plan().units) == [(0, ids(4)), (1, ["s004", "s005"]), (2, ["s006", "s007", "s008"])]


def test_a_broken_state_folder_is_refused_with_what_to_do(tmp_path: Path) -> None:
    from diffprep.errors import DiffprepError, LinkInOutputError

    units, _, _ = plan_units(ids(6), shard_size=4)
    path = write_plan(tmp_path / "out", make_plan(units))
    (path.parent / "plan_units" / "000001.jsonl").unlink()
    plan = read_plan(tmp_path / "out")
    assert plan.total_samples == 6  # plan.json alone answers counts
    with pytest.raises(DiffprepError, match=r"unit 1's sample list .* is missing.*--on-existing new-dir"):
        plan.unit(1).source_ids
    (path.parent / "plan_units" / "000000.jsonl").write_text('"s000"\n')
    with pytest.raises(DiffprepError, match="holds 1 samples, plan.json plans 4"):
        read_plan(tmp_path / "out").unit(0).source_ids
    data = json.loads(path.read_text())
    data["units"][0]["file"] = "../../elsewhere.jsonl"
    path.write_text(json.dumps(data))
    with pytest.raises(DiffprepError, match="not written by diffprep"):
        read_plan(tmp_path / "out")
    # A link where a list goes: nothing is written through it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked" / contract.STATE_DIR).mkdir(parents=True)
    (tmp_path / "linked" / contract.STATE_DIR / contract.PLAN_UNITS_DIR).symlink_to(elsewhere)
    with pytest.raises(LinkInOutputError):
        write_plan(tmp_path / "linked", make_plan(plan_units(ids(2), shard_size=4)[0]))
    assert not list(elsewhere.iterdir())


def old_form(out: Path) -> None:
    """Rewrite an output's plan as versions before issue 37 wrote it: every unit's ids inline, no lists."""
    import shutil

    path = plan_path(out)
    data = json.loads(path.read_text())
    plan = read_plan(out)
    data["units"] = [{"unit": u.unit, "source_ids": u.source_ids, **({"bucket": u.bucket} if u.bucket else {})}
                     for u in plan.units]
    shutil.rmtree(path.parent / contract.PLAN_UNITS_DIR)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def test_a_plan_json_of_an_earlier_version_is_read_and_converted(tmp_path: Path) -> None:
    units, _, _ = plan_units(ids(6), shard_size=4)
    write_plan(tmp_path / "out", make_plan(units))
    old_form(tmp_path / "out")
    old = read_plan(tmp_path / "out")
    assert as_pairs(old.units) == [(0, ids(4)), (1, ["s004", "s005"])] and old.total_samples == 6

    grown, _, _ = plan_units(ids(8), shard_size=4, previous=old)
    write_plan(tmp_path / "out", make_plan(grown))
    assert "source_ids" not in plan_path(tmp_path / "out").read_text()
    assert as_pairs(read_plan(tmp_path / "out").units) == [(0, ids(4)), (1, ["s004", "s005"]), (2, ["s006", "s007"])]


def test_an_output_with_an_old_plan_json_resumes_and_appends(settings_for, tiny_model, demo_data, tmp_path) -> None:
    from diffprep.phases.pipeline import run

    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"shard_size": 5})
    first = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    shards = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    planned = as_pairs(read_plan(out).units)
    old_form(out)
    images, captions = demo_data / "images", demo_data / "captions"
    (images / "zzz.png").write_bytes((images / "00001.png").read_bytes())
    (captions / "zzz.txt").write_text("a new sample")

    again = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))

    assert (first.samples, again.action, again.samples) == (12, "resume", 13)
    assert {name: (out / name).read_bytes() for name in shards} == shards  # old shards untouched
    assert as_pairs(read_plan(out).units) == [*planned, (3, ["zzz.png"])]
    assert "source_ids" not in plan_path(out).read_text()  # converted: the lists in files of their own
    assert sorted(p.name for p in (out / contract.STATE_DIR / contract.PLAN_UNITS_DIR).iterdir()) == [
        f"{unit:06d}.jsonl" for unit in range(4)]


def test_buckets_are_asked_a_chunk_of_new_ids_at_a_time(monkeypatch) -> None:
    """A bucketing run probes its new ids in chunks (retried ids first), never its whole listing at once; the units
    are those that asking one id at a time gives."""
    from diffprep.writer import plan as plan_module

    monkeypatch.setattr(plan_module, "LISTING_CHUNK", 3)
    buckets = {f"n{i}": ("a" if i % 3 else "b") for i in range(8)}
    first, _, _ = plan_units(["p0", "p1"], shard_size=2)
    asked: list[list[str]] = []

    def buckets_of(batch: list[str]) -> dict[str, str]:
        asked.append(batch)
        return {sid: buckets.get(sid, "b") for sid in batch}

    units, _, _ = plan_units(["p0", "p1", *buckets], shard_size=2, previous=make_plan(first), retry=["p1"],
                             buckets_of=buckets_of, max_samples=8)
    assert asked == [["p1", "n0", "n1"], ["n2", "n3", "n4"], ["n5"]]  # the limit: 2 planned + 6 new
    one_at_a_time, _, _ = plan_units(["p0", "p1", *buckets], shard_size=2, previous=make_plan(first), retry=["p1"],
                                     bucket_of=lambda sid: buckets.get(sid, "b"), max_samples=8)
    assert [(u.source_ids, u.bucket) for u in units] == [(u.source_ids, u.bucket) for u in one_at_a_time]


@pytest.mark.usefixtures("aws_env")
def test_a_bucket_output_downloads_only_the_lists_of_the_units_read(admin, proxy) -> None:
    import shutil
    import uuid

    from diffprep.output import open_output

    url = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}"
    output = open_output(url, endpoint_url=proxy.url)
    units, _, _ = plan_units(ids(10), shard_size=4)
    output.state.write_plan(make_plan(units))
    shutil.rmtree(output.local / contract.STATE_DIR)  # another machine: nothing staged
    proxy.reset()

    plan = open_output(url, endpoint_url=proxy.url).state.plan()
    assert plan.total_samples == 10 and plan.unit(1).source_ids == ["s004", "s005", "s006", "s007"]

    key = url.removeprefix("s3://") + f"/{contract.STATE_DIR}/"
    fetched = sorted(r.path.removeprefix("/" + key) for r in proxy.log if r.method == "GET" and r.path.startswith(
        "/" + key))
    assert fetched == [contract.PLAN_JSON, contract.plan_unit_path(1)]


def test_a_unit_list_line_is_json_dumps_of_its_entry() -> None:
    """The lines written without json.dumps (a plain id, a list of ints) are its bytes, and the others go through it."""
    from diffprep.writer.unit_lists import entry_line

    for sid, at in [("a/b.png#3", [12, 3, 3, 4022208669]), ("k", []), ("s", [-5, 2**70]), ('q"', [1]),
                    ("é", [1]), ("t", [True, 1]), ("f", [1.5]), ("n", [1, [2]]), ("d", {"a": 1}), ("x\n", None)]:
        want = json.dumps(sid) if at is None else json.dumps([sid, at], separators=(",", ":"))
        assert entry_line(sid, at) == want and json.loads(want) == (sid if at is None else [sid, at])
