"""Errors a user can act on come before anything starts: no server, no encoder loaded, nothing written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from diffprep.cli import main
from diffprep.errors import ConfigError, SourceError
from diffprep.preflight import preflight


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the command gets as far as starting the Prefect server or loading encoders."""
    def started(*args, **kwargs):
        raise AssertionError("the command started the server or the encoders before its settings were checked")

    monkeypatch.setattr("diffprep.flows.startup.warm_start", started)
    monkeypatch.setattr("diffprep.flows.startup.start_embedded_server", started)


def _encode(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--input-dir", str(data), "--model-path", str(model), "--output-dir", str(out),
            "--image-size", "32", "--min-psnr", "0", *extra]


def test_settings_naming_what_is_not_there_are_refused(settings_for, demo_data, tiny_model, tmp_path):
    preflight(settings_for(tmp_path / "out", demo_data, tiny_model))  # a sound run passes

    with pytest.raises(SourceError, match="source.input_dir .*does not exist.*--input-dir"):
        preflight(settings_for(tmp_path / "out", tmp_path / "nowhere", tiny_model))
    with pytest.raises(SourceError, match="source.metadata_file .*does not exist"):
        preflight(settings_for(tmp_path / "out", demo_data, tiny_model,
                               source={"type": "metadata", "metadata_file": str(tmp_path / "none.json")}))

    token = tmp_path / "token"
    token.write_text("hf_abc\n")
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        preflight(settings_for(tmp_path / "out", demo_data, tiny_model, auth={"hf_token_file": str(token)}))
    token.chmod(0o600)
    preflight(settings_for(tmp_path / "out", demo_data, tiny_model, auth={"hf_token_file": str(token)}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_fails_at_once_and_writes_nothing(nothing_starts, demo_data, tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    started = time.monotonic()
    assert main(_encode(demo_data, tiny_model, out, "--device", "cuda")) == 2
    assert time.monotonic() - started < 10
    assert "model.device is 'cuda' but CUDA is not available here" in capsys.readouterr().err
    assert not out.exists()  # no plan.json that would make the next run ask about "other settings"


def test_missing_input_and_open_token_file_fail_before_the_server(nothing_starts, demo_data, tiny_model, tmp_path,
                                                                   capsys):
    out = tmp_path / "out"
    assert main(_encode(tmp_path / "typo", tiny_model, out)) == 2
    assert "source.input_dir" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text("hf_abc")
    token.chmod(0o640)
    assert main(_encode(demo_data, tiny_model, out, "--hf-token-file", str(token))) == 2
    assert "chmod 600" in capsys.readouterr().err
    assert not out.exists()
