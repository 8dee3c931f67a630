"""Running encode-dataset in tests: small explicit parameters, a run in a thread, answering its questions.

A run that asks a question pauses; ``BackgroundRun.wait_for_question`` finds
the paused run through the API (by its unique flow-run name) and reads the
question the UI would show; ``answer`` resumes it the way the UI's form does.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.flow_runs import resume_flow_run

from diffprep.config import EncodeParameters
from diffprep.flows.encode import encode_dataset

RUN_TIMEOUT = 120  # seconds a whole tiny run may take on 2 busy cores


def parameters(data: Path, model: Path, out: Path, **sections: dict[str, Any]) -> EncodeParameters:
    """Tiny, explicit flow parameters: 4 samples a shard, 32 px, 16 T5 tokens, fp32 on the CPU."""
    given: dict[str, dict[str, Any]] = {
        "source": {"type": "directory", "input_dir": str(data)},
        # A bounded wait: a test that fails before answering leaves no run paused for an hour.
        "output": {"output_dir": str(out), "shard_size": 4, "approval_timeout": RUN_TIMEOUT},
        "model": {"model_path": str(model), "precision": "fp32", "device": "cpu", "batch_size": 4,
                  "t5_max_length": 16, "min_psnr": 0.0},  # the tiny VAE cannot reconstruct images
        "image": {"image_size": 32, "decode_workers": 1},
    }
    for section, values in sections.items():
        given.setdefault(section, {}).update(values)
    return EncodeParameters(**given)


def shard_samples(out: Path) -> dict[str, dict[str, bytes]]:
    """Every sample in the shards of ``out``: key -> field -> the member's bytes."""
    samples: dict[str, dict[str, bytes]] = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                key, field = member.name.split(".", 1)
                samples.setdefault(key, {})[field] = archive.extractfile(member).read()
    return samples


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` -> sha256 of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class BackgroundRun:
    """``encode_dataset(parameters)`` in a thread, under a flow-run name unique to this test."""

    def __init__(self, params: EncodeParameters) -> None:
        self.name = f"test-{uuid.uuid4().hex[:12]}"
        self.result: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(params,), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, params: EncodeParameters) -> None:
        try:
            self.result = encode_dataset.with_options(flow_run_name=self.name)(params)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def flow_run(self) -> FlowRun | None:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[self.name])))
        assert len(runs) <= 1, f"{len(runs)} flow runs named {self.name}"
        return runs[0] if runs else None

    def wait_for_question(self, key: str, timeout: float = RUN_TIMEOUT) -> tuple[FlowRun, str]:
        """The paused run and the question's Markdown, once the run waits for an answer to ``key``.

        A run is Paused a moment before its input schema and description are
        saved, and a resume before that is rejected: wait for the description,
        which is saved last.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise AssertionError(f"the run ended without asking {key!r}: "
                                     f"result {self.result}, error {self.error!r}")
            run = self.flow_run()
            if run is not None and run.state is not None and run.state.is_paused():
                details = run.state.state_details
                assert details.pause_key == key, f"paused for {details.pause_key!r}, expected {key!r}"
                description = self._input(run, details.run_input_keyset["description"])
                if description is not None:
                    return run, description
            time.sleep(0.2)
        raise AssertionError(f"the run did not pause for {key!r} within {timeout} s")

    @staticmethod
    def _input(run: FlowRun, key: str) -> str | None:
        with get_client(sync_client=True) as client:
            try:
                return json.loads(client.read_flow_run_input(run.id, key))
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code == 404:
                    return None
                raise

    def join(self, timeout: float = RUN_TIMEOUT) -> StateType:
        """Wait for the run to end; the final state of its flow run."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the run did not end within {timeout} s"
        run = self.flow_run()
        assert run is not None and run.state is not None
        return run.state.type


class FinishedRun(NamedTuple):
    data: Path
    model: Path
    out: Path
    flow_run_id: uuid.UUID
    result: dict


def answer(run: FlowRun, choice: str) -> None:
    resume_flow_run(run.id, run_input={"answer": choice})
