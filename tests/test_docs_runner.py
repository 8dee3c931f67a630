"""The documentation runner's own rules (tests/test_docs.py), on small pages written here: what runs, what only
parses, and what a page may not do. No page here encodes anything: each takes a second."""

from __future__ import annotations

from pathlib import Path

import pytest

import test_docs
from test_docs import hub_cache  # noqa: F401 - the fixture, for test_page

FENCE = "```"


def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text.replace("'''", FENCE))
    return path


def run_page(path: Path, hub_cache, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    test_docs.test_page(path, hub_cache, tmp_path / "run", monkeypatch)


def test_console_commands_run_in_one_terminal_in_order(hub_cache, tmp_path, monkeypatch):  # noqa: F811
    path = page(tmp_path, (
        "'''console\n$ diffprep demo --data-only --workdir demo\ndemo data written to ... (output: not checked)\n"
        "$ export WHO=reader\n$ mkdir sub\n$ cd sub\n$ echo \"hello $WHO\" \\\n    > note.txt\n'''\n\n"
        "'''python\nfrom pathlib import Path\nassert Path('note.txt').read_text() == 'hello reader\\n'\n"
        "assert len(list(Path('../demo/demo-data/images').iterdir())) == 24\n'''\n"))
    run_page(path, hub_cache, tmp_path, monkeypatch)
    assert not (tmp_path / "run" / "work" / "demo" / "demo-out").exists()  # --data-only: the data, no run


def test_a_failing_command_fails_the_page(hub_cache, tmp_path, monkeypatch):  # noqa: F811
    path = page(tmp_path, "'''console\n$ diffprep validate ./nothing-here\n'''\n")
    with pytest.raises(AssertionError, match="nothing-here"):
        run_page(path, hub_cache, tmp_path, monkeypatch)


def test_parse_only_blocks_are_parsed_with_the_real_parser(hub_cache, tmp_path, monkeypatch):  # noqa: F811
    good = page(tmp_path, (
        "<!-- check: parse-only — eight GPUs -->\n'''console\n"
        "$ torchrun --nproc_per_node=8 -m diffprep encode --config my.yaml --devices auto\n"
        "$ srun --gpus-per-task=1 diffprep encode --config my.yaml\n"
        "$ PRIMUS_DATA_ROOT=/data diffprep ingest --config mlperf_flux1.yaml\n"
        "$ sbatch configs/slurm-encode.sbatch\n'''\n"))
    run_page(good, hub_cache, tmp_path, monkeypatch)
    bad = page(tmp_path, "<!-- check: parse-only — a GPU -->\n'''console\n$ diffprep encode --no-such-flag 1\n'''\n")
    with pytest.raises(AssertionError, match="does not parse"):
        run_page(bad, hub_cache, tmp_path, monkeypatch)


@pytest.mark.parametrize("text, why", [
    ("'''bash\ndiffprep encode --config my.yaml\n'''\n", "console"),
    ("<!-- check: skip -->\n'''console\n$ diffprep encode\n'''\n", "parse-only"),
    ("'''console\ndiffprep encode --config my.yaml\n'''\n", "without a `\\$ ` command"),
])
def test_what_a_page_may_not_do(text, why, hub_cache, tmp_path, monkeypatch):  # noqa: F811
    with pytest.raises(ValueError, match=why):
        run_page(page(tmp_path, text), hub_cache, tmp_path, monkeypatch)


def test_diffprep_arguments_are_found_behind_launchers():
    assert test_docs.diffprep_argv("torchrun --nnodes=2 -m diffprep encode --config a.yaml") == [
        "encode", "--config", "a.yaml"]
    assert test_docs.diffprep_argv("diffprep validate ./out | tail -1") == ["validate", "./out"]
    assert test_docs.diffprep_argv("git clone https://example.org/diffprep && cd diffprep") is None
    assert test_docs.diffprep_argv("cd diffprep") is None
