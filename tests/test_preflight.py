"""Errors a user can act on come before anything starts: no server, no encoder loaded, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffprep.cli import main
from diffprep.errors import ConfigError, SourceError
from diffprep.phases.preflight import preflight


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


# --- a fresh command, as a user runs it ------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _command(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``diffprep ARGS`` as a user starts it: a process of its own, no PREFECT_API_URL, a PREFECT_HOME of its own
    (returned, to look into: the embedded server creates its database there when it starts)."""
    home = tmp_path / f"prefect-home-{len(list(tmp_path.glob('prefect-home-*')))}"
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "DIFFPREP_LIVE_FLOW")}
    env |= {"PYTHONPATH": str(REPO), "PREFECT_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "diffprep", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    return done, home


def _refused_before_prefect(tmp_path: Path, message: str, *args: str) -> None:
    done, home = _command(tmp_path, *args)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert message in done.stderr, said
    # No server started, so no flow run recorded as Failed: the home's database is never created.
    assert "embedded Prefect server" not in said and "recorded as flow run" not in said, said
    assert not (home / "prefect.db").exists(), said


@pytest.mark.slow
def test_settings_errors_a_plan_used_to_find_end_the_command_before_any_prefect_server(demo_data, tiny_model,
                                                                                       tmp_path):
    from test_edm_zip import write_cifar, write_classes

    tarball = tmp_path / "cifar-10-python.tar.gz"
    write_cifar(tarball, count=1)
    cifar = ["raw", "--source-type", "cifar10", "--input-path", str(tarball), "--output-dir", str(tmp_path / "c")]
    images = ["raw", "--input-dir", str(demo_data), "--output-dir", str(tmp_path / "o")]
    # What the layout allows, contradicted by a flag typed: the encoding's own check, named by that flag.
    _refused_before_prefect(tmp_path, "--layout edm-zip stores PNG files (EDM's dataset_tool); remove --image-format "
                            "jpg", *images, "--layout", "edm-zip", "--image-format", "jpg")
    _refused_before_prefect(tmp_path, "CIFAR-10 is 32 px and its archive stores it as it is",
                            *cifar, "--layout", "edm-zip", "--image-size", "64")
    # The source type alone says how many classes there are (or that there are none).
    _refused_before_prefect(tmp_path, "contradicts the cifar10 source's 10 classes", *cifar, "--num-classes", "100")
    _refused_before_prefect(tmp_path, "this directory source has no labels", *images, "--num-classes", "10")
    folders = write_classes(tmp_path / "train", {"a": [(40, 40)], "b": [(40, 40)]})  # a class folder's top level
    _refused_before_prefect(tmp_path, "contradicts the imagefolder source's 2 classes", "raw", "--source-type",
                            "imagefolder", "--input-dir", str(folders), "--output-dir", str(tmp_path / "o"),
                            "--num-classes", "5")
    _refused_before_prefect(tmp_path, "source.input_path", "raw", "--source-type", "cifar10", "--input-path",
                            str(tmp_path / "cifar-typo.tar.gz"), "--output-dir", str(tmp_path / "c"))
    # A pre-encoded run with a local model: its family's checks; a --devices spec that does not parse.
    encode = ["encode", "--input-dir", str(demo_data), "--model-path", str(tiny_model), "--output-dir",
              str(tmp_path / "e")]
    _refused_before_prefect(tmp_path, "--audio-durations '2' is LTX-2's audio-only mode", *encode,
                            "--audio-durations", "2")
    _refused_before_prefect(tmp_path, "workers.devices 'cpu:two'", *encode, "--devices", "cpu:two")
    assert not any((tmp_path / name).exists() for name in ("c", "o", "e"))
