"""The user path, captions: `diffprep caption` started as a new process in a fresh terminal (tests/user_shell.py)
over images and a clip without captions, with the tiny random-weight Qwen2.5-VL (the question before replacing a set
is tests/test_caption_sets.py's, in this process: a refused command here costs its recording, 30 s on 2 cores)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from test_caption_sets import media_folder
from user_shell import Terminal, module_terminal, recorded

pytestmark = [pytest.mark.user_path, pytest.mark.slow]


@pytest.fixture(scope="module")
def term(tmp_path_factory) -> Iterator[Terminal]:
    yield from module_terminal(tmp_path_factory, "user-captions", __name__)


def test_caption_a_folder_with_the_tiny_vlm(term: Terminal) -> None:
    from diffprep.captions.tiny import write_tiny_qwen2_5_vl

    media_folder(term.cwd / "data")
    write_tiny_qwen2_5_vl(term.cwd / "tiny-vlm")
    command = ("diffprep caption --input-dir data --name first --caption-model ./tiny-vlm --max-new-tokens 6 "
               "--unit-size 2 --ltx-metadata data/dataset.jsonl")
    ran = recorded(term.run(command).ok()).says("caption set: ", "(fresh, fingerprint",
                                                "captioned: 4   rejected: 1", "LTX metadata file:")
    folder = term.cwd / "data" / ".captions" / "first"
    record = json.loads((folder / "set.json").read_text())
    assert record["digest"] and record["captioner"]["settings"]["max_new_tokens"] == 6
    assert (folder / "sanity" / "frames.png").is_file() and "sanity: blue.png captioned" in ran.output
    rows = [json.loads(line) for line in (term.cwd / "data" / "dataset.jsonl").read_text().splitlines()]
    assert [r["media_path"] for r in rows] == ["images/blue.png", "videos/clip.mp4", "images/green.png",
                                               "images/red.png"] and all(r["caption"] for r in rows)
