"""What a terminal shows besides the run's own lines: bounded warnings, no loading bars, each message once."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import yaml

from diffprep.errors import DiffprepError
from diffprep.families.base import REMOVED_EXCERPT_CHARS, removed_excerpt

REPO = Path(__file__).resolve().parents[1]


def test_truncation_warning_shows_a_bounded_excerpt_with_the_counts():
    removed = ["word " * 3300, "short tail", "x" * 500, "y" * 500, "z"]  # a scraped caption loses 16,500 chars
    line = removed_excerpt(removed)
    assert len(line) < 4 * REMOVED_EXCERPT_CHARS + 200
    assert "(+16380 characters)" in line and "'short tail'" in line and "and 2 more caption(s)" in line


def test_t5_truncation_log_line_is_bounded(tiny_model, caplog):
    from diffprep.config import ModelConfig
    from diffprep.families.flux import FluxEncoders

    encoders = FluxEncoders.load(ModelConfig(model_path=str(tiny_model), precision="fp32", device="cpu",
                                             t5_max_length=16))
    with caplog.at_level(logging.INFO, logger="diffprep.families.flux"):
        encoders.encode_text(["a photo of " + "a very long caption " * 2000])
    lines = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert lines and all(len(line) < 600 for line in lines), [len(line) for line in lines]
    assert any("characters)" in line for line in lines)


def test_no_loading_bars_and_no_socks_warning(tmp_path):
    # The command as a user runs it (warnings shown as Python shows them by default, plus urllib3's own).
    run = subprocess.run([sys.executable, "-W", "default", "-m", "diffprep", "tiny-model", str(tmp_path / "m")],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                              "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert "Writing model shards" not in run.stderr and "it/s" not in run.stderr, run.stderr
    assert "SOCKS" not in run.stderr, run.stderr
    socks = subprocess.run([sys.executable, "-W", "always", "-c",
                            "from diffprep.cli import quiet_libraries; quiet_libraries()\n"
                            "try:\n    import urllib3.contrib.socks\nexcept ImportError:\n    pass"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "SOCKS" not in socks.stderr, socks.stderr


def test_a_user_error_is_printed_in_full_once():
    from diffprep.flows.startup import _UserErrorsWithoutTraceback

    error = DiffprepError("The output already holds data: nothing was changed.\n\n**Output:** `/x`\n- notes.txt")
    formatter = _UserErrorsWithoutTraceback(logging.Formatter("%(message)s"))
    raised = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1,
                               "Encountered exception during execution: %r", (error,), (DiffprepError, error, None))
    final = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "Finished in state %r",
                              (f"Failed('Flow run encountered an exception: DiffprepError: {error}')",), None)
    for record in (raised, final):
        text = formatter.format(record)
        assert "nothing was changed. ... (in full below)" in text and "notes.txt" not in text, text
        assert "Traceback" not in text


def test_docs_deploy_comment_names_every_deployment():
    flows = {}
    for path in (REPO / "flows").glob("*.py"):
        for name in re.findall(r'@flow\(name="([\w-]+)"', path.read_text()):
            flows[f"flows/{path.name}"] = name
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {f"{flows[d['entrypoint'].split(':')[0]]}/{d['name']}" for d in config["deployments"]}
    page = (REPO / "docs" / "scale-out.md").read_text()  # the work pools' commands (Scale-out)
    comment = page[page.index("prefect deploy --all    #"):]
    comment = comment[:comment.index("```")]
    assert len(deployments) == 5 and {d for d in deployments if d in comment} == deployments, comment
