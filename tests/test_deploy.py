"""Deployments, blocks, a worker and ``diffprep serve`` against a real Prefect server, as a user runs them.

The Prefect CLI runs in subprocesses (``prefect block register``, ``prefect
deploy --all`` with the project's prefect.yaml, ``prefect worker start``,
``diffprep serve``) pointed at the session's test server; the flow runs they
execute are real runs on the demo data with the tiny encoders.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple
from uuid import UUID

import pytest

from diffprep import contract

# Prefect's console log handler keeps the stream it finds when prefect is first imported: import it
# here, at collection, so it holds pytest's session stream rather than one test's capture buffer.
import diffprep.flows.validate  # noqa: F401

from diffprep.config import EncodeParameters
from diffprep.tools.demo import write_demo_dataset
from diffprep.validation import validate_dataset
from prefect_cli import Process, run, wait_for_state

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "diffprep-gpu"
HF_TOKEN = "hf_test_token_that_must_never_be_logged"
pytestmark = pytest.mark.slow


# --- helpers -------------------------------------------------------------------------------------


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    """Run a command to completion (failing the test with its output when it fails); its output."""
    done = run(args, env, cwd, timeout=timeout)
    return done.stdout + done.stderr


def _wait_final(flow_run_id: UUID, seconds: float, process: Process):
    """The flow run once its state is final; fails after ``seconds`` with the state and the process's output."""
    return wait_for_state(flow_run_id, lambda state: state.is_final(), seconds, process)


def _logs(flow_run_id: UUID) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def _markdown_artifacts(flow_run_id: UUID) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["markdown"])))


class Encoded(NamedTuple):
    out: Path
    flow_run_id: UUID


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_env(prefect_server, tmp_path_factory) -> dict[str, str]:
    """The environment of a user's shell pointed at the test server: venv on PATH, offline, quiet."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFPREP_", "PREFECT_"))}
    env.update(
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        HF_HUB_OFFLINE="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


@pytest.fixture(scope="module")
def deployed(cli_env) -> None:
    """The project's prefect.yaml deployed the way the README says, from the repository root."""
    _run(["prefect", "work-pool", "create", POOL, "--type", "process"], cli_env, REPO)
    _run(["prefect", "--no-prompt", "deploy", "--all"], cli_env, REPO)


@pytest.fixture(scope="module")
def encoded(deployed, cli_env, tiny_model, tmp_path_factory) -> Encoded:
    """A dataset written by encode-dataset/default, run by a process worker; the encoders come from saved blocks."""
    from prefect.deployments import run_deployment

    from diffprep.blocks import EncoderSpec, HuggingFaceCredentials

    root = tmp_path_factory.mktemp("deploy")
    data = write_demo_dataset(root / "demo-data", samples=8)
    out = root / "out"
    EncoderSpec(model_path=str(tiny_model), precision="fp32", t5_max_length=16).save("tiny-test", overwrite=True)
    HuggingFaceCredentials(token=HF_TOKEN).save("hf-test", overwrite=True)
    run = run_deployment(name="encode-dataset/default", timeout=0, parameters={"parameters": {
        "encoder_spec": "tiny-test",
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 4},
        "model": {"device": "cpu", "batch_size": 4, "min_psnr": 0.0},  # the tiny VAE cannot reconstruct
        "image": {"image_size": 32, "decode_workers": 1},
        "auth": {"hf_credentials_block": "hf-test"},
    }})
    # The worker runs from elsewhere: the deployment's pull step changes into the checkout.
    worker = Process(["prefect", "worker", "start", "--pool", POOL, "--run-once"], cli_env, root,
                      root / "worker.log")
    try:
        finished = _wait_final(run.id, 240, worker)
        assert finished.state.is_completed(), f"{finished.state}; worker output:\n{worker.tail()}"
        worker.popen.wait(timeout=60)  # --run-once: it exits once its run is over
        assert worker.popen.returncode == 0, worker.tail()
    finally:
        worker.stop()
    return Encoded(out, run.id)


# --- tests ---------------------------------------------------------------------------------------


def test_blocks_register_from_the_cli(cli_env, tmp_path):
    from prefect.client.orchestration import get_client

    output = _run(["prefect", "block", "register", "-m", "diffprep.blocks"], cli_env, tmp_path)
    assert "diffprep encoder spec" in output and "diffprep hugging face credentials" in output
    with get_client(sync_client=True) as client:
        spec = client.read_block_type_by_slug("diffprep-encoder-spec")
        creds = client.read_block_type_by_slug("diffprep-hugging-face-credentials")
        spec_fields = client.get_most_recent_block_schema_for_block_type(spec.id).fields
        creds_fields = client.get_most_recent_block_schema_for_block_type(creds.id).fields
    assert {"model_path", "vae_path", "t5_path", "clip_path", "precision", "t5_max_length"} <= set(
        spec_fields["properties"])
    t5_length = spec_fields["properties"]["t5_max_length"]
    assert [choice.get("maximum") for choice in t5_length.get("anyOf", [t5_length])] == [512, None]
    assert creds_fields["secret_fields"] == ["token"]


def test_prefect_yaml_deploys_forms_and_an_inactive_nightly_schedule(deployed):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        encode = client.read_deployment_by_name("encode-dataset/default")
        nightly = client.read_deployment_by_name("encode-dataset/nightly-append")
        validate = client.read_deployment_by_name("validate-dataset/default")

    for deployment in (encode, nightly, validate):
        assert deployment.work_pool_name == POOL
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        assert deployment.job_variables["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "diffprep"
    assert encode.schedules == [] and validate.schedules == []
    [schedule] = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.active is False
    # The example append parameters are valid settings (a typo in prefect.yaml fails here, not at 2 am).
    EncodeParameters.model_validate(nightly.parameters["parameters"])

    # The UI form: one pydantic model with descriptions, enums and bounds.
    schema = encode.parameter_openapi_schema
    assert encode.enforce_parameter_schema
    assert schema["properties"]["parameters"]["anyOf"][0] == {"$ref": "#/definitions/EncodeParameters"}
    output = schema["definitions"]["OutputConfig"]["properties"]
    assert output["shard_size"]["minimum"] == 1 and "Samples per tar shard" in output["shard_size"]["description"]
    assert output["on_existing"]["anyOf"][0]["enum"] == ["resume", "overwrite", "abort", "new-dir", "reuse"]
    assert schema["definitions"]["ModelConfig"]["properties"]["precision"]["enum"] == ["bf16", "fp16", "fp32"]
    assert "YAML config" in schema["definitions"]["EncodeParameters"]["properties"]["config"]["description"]
    vschema = validate.parameter_openapi_schema
    assert vschema["required"] == ["out_dir"] and vschema["properties"]["out_dir"]["description"]
    assert vschema["properties"]["encoding"]["anyOf"][0]["enum"] == list(contract.ENCODINGS)  # a dropdown of them all

    # The server enforces the bounds before a run exists.
    with pytest.raises(PrefectHTTPStatusError, match="shard_size.*less than the minimum of 1"):
        run_deployment(name="encode-dataset/default", timeout=0,
                       parameters={"parameters": {"output": {"shard_size": 0}}})


def test_a_worker_completes_encode_dataset_from_the_deployment(encoded):
    assert validate_dataset(encoded.out).ok
    messages = [log.message for log in _logs(encoded.flow_run_id)]
    # The work pool's job variables reach the run: the library's log lines are in the run log.
    assert any("unit 000000: 4 written, 0 rejected" in m for m in messages), messages
    assert not any(HF_TOKEN in m for m in messages)


def test_validate_dataset_flow_fails_the_run_and_reports(prefect_server, tmp_path):
    from diffprep.flows.validate import validate_dataset_flow

    state = validate_dataset_flow(str(tmp_path), return_state=True)
    assert state.is_failed()
    [artifact] = _markdown_artifacts(state.state_details.flow_run_id)
    assert "FAILED" in artifact.data and str(tmp_path) in artifact.data


def test_diffprep_serve_runs_validate_dataset(encoded, cli_env, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    serve = Process(["diffprep", "serve"], cli_env, tmp_path, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 90
        with get_client(sync_client=True) as client:
            while True:
                try:
                    client.read_deployment_by_name("validate-dataset/serve")
                    break
                except ObjectNotFound:
                    assert serve.popen.poll() is None, f"diffprep serve exited:\n{serve.tail()}"
                    assert time.monotonic() < deadline, f"no served deployment after 90 s:\n{serve.tail()}"
                    time.sleep(1)
        assert "prefect deployment run validate-dataset/serve" in serve.tail()
        run = run_deployment(name="validate-dataset/serve", timeout=0,
                             parameters={"out_dir": str(encoded.out), "max_load": 2})
        finished = _wait_final(run.id, 120, serve)
        assert finished.state.is_completed(), f"{finished.state}; serve output:\n{serve.tail()}"
        [artifact] = _markdown_artifacts(run.id)
        assert artifact.data.startswith(f"# Validation passed: `{encoded.out}`")
    finally:
        serve.stop()


def test_serve_without_a_server_says_how_to_start_one(cli_env, tmp_path):
    env = {k: v for k, v in cli_env.items() if k != "PREFECT_API_URL"}
    done = subprocess.run(["diffprep", "serve"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "prefect server start" in done.stderr and "PREFECT_API_URL" in done.stderr
