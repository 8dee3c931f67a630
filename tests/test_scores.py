"""Score columns (--score-column): the numbers a metadata file's rows give, as FastGen's presets_filter reads them
from a sample's json member; what is left out, what is refused, and the flags."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.cli import build_parser, overrides_from
from diffprep.config import OutputConfig, Settings, SourceConfig
from diffprep.errors import RejectError, SourceError
from diffprep.writer.layouts import LayoutPreset, layout_for
from diffprep.sources import open_source
from diffprep.sources.scores import score_value


def test_a_cell_is_a_finite_number_or_left_out_or_refused():
    assert [score_value(v, "s", "row 1") for v in (6.5, 3, "4.25", " 7 ", "1e2")] == [6.5, 3, 4.25, 7, 100.0]
    assert [score_value(v, "s", "row 1") for v in (None, "", "  ", math.nan, "nan")] == [None] * 5
    for bad in ("high", True, [1], {"a": 1}, math.inf, "-inf"):
        with pytest.raises(RejectError, match="column 's'") as error:
            score_value(bad, "s", "row 1")
        assert error.value.reason == "invalid_score"


def test_metadata_rows_give_their_scores_and_the_columns_are_checked(tmp_path: Path):
    (tmp_path / "a.png").write_bytes(b"not read here")
    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "caption", "aesthetic_score", "clip_score"])
        writer.writerows([["a.png", "one", "6.5", "0.3"], ["a.png", "two", "", "0.1"], ["a.png", "three", "x", "1"]])
    source = open_source(SourceConfig(type="metadata", metadata_file=str(tmp_path / "d.csv"),
                                      score_columns=["aesthetic_score", "clip_score"]))
    samples = list(source.read(list(source.list_ids())))
    assert [dict(s.scores) for s in samples[:2]] == [{"aesthetic_score": 6.5, "clip_score": 0.3}, {"clip_score": 0.1}]
    assert samples[2].reject.reason == "invalid_score" and "'x' is not a number" in samples[2].reject.detail
    assert source.describe()["score_columns"] == ["aesthetic_score", "clip_score"]
    # Without score columns a sample has none, and the row stamps stay as they were.
    plain = open_source(SourceConfig(type="metadata", metadata_file=str(tmp_path / "d.csv")))
    assert not any(s.scores for s in plain.read(list(plain.list_ids())))
    with pytest.raises(SourceError, match="--score-column motion is not a column"):
        open_source(SourceConfig(type="metadata", metadata_file=str(tmp_path / "d.csv"), score_columns="motion"))
    (tmp_path / "e.jsonl").write_text(json.dumps({"image": "a.png", "caption": "c", "fps": 3}), encoding="utf-8")
    with pytest.raises(SourceError, match="meta already has a field of that name"):
        open_source(SourceConfig(type="metadata", metadata_file=str(tmp_path / "e.jsonl"), score_columns="fps"))
    with pytest.raises(SourceError, match="reads the columns of a metadata file"):
        open_source(SourceConfig(type="directory", input_dir=str(tmp_path), score_columns="aesthetic_score"))


def test_score_flags_repeat_or_take_a_comma_list():
    args = build_parser().parse_args(["raw", "--score-column", "aesthetic_score,clip_score", "--score-column",
                                      "motion", "--keep-audio"])
    overrides = overrides_from(args)
    assert overrides["raw"] == {"keep_audio": True}
    assert Settings(source=overrides["source"]).source.score_columns == ["aesthetic_score", "clip_score", "motion"]
    assert SourceConfig(score_columns="a, b,a").score_columns == ["a", "b"]


def test_the_fastgen_layout_writes_a_scored_meta_as_the_json_member():
    preset = {contract.LAYOUT_FASTGEN: LayoutPreset(members={contract.FASTGEN_LATENT: (contract.LATENTS,)},
                                                   shard_counts=True)}
    fields = [contract.LATENTS, contract.CAPTION, contract.META]
    output = OutputConfig(output_dir="/x", layout="fastgen")
    plain = layout_for(output, None, "wan", preset, fields)
    scored = layout_for(output, None, "wan", preset, fields, scores=True)
    assert contract.META in plain.members and contract.SCORE_JSON not in plain.members
    assert scored.members[contract.SCORE_JSON] == (contract.META,) and contract.META not in scored.members
    written = scored.write({contract.LATENTS: 1, contract.CAPTION: "c", contract.META: {"aesthetic_score": 6.0}})
    assert sorted(written) == sorted([contract.FASTGEN_LATENT, contract.CAPTION, "json"])
    assert scored.read({"json": b"{}"})[contract.META] == b"{}"
