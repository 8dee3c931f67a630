"""docs/prefect-server.md's screenshots, taken from the real Prefect UI by the test that answers an approval in it.

A user's path on a server, with the tiny encoders: ``prefect server start`` (UI on), the project's prefect.yaml
deployed with ``prefect deploy --all``, a run of encode-dataset/default over an output written with other settings
(32 px, the run asks for 48 px), so the run pauses on the existing-output question. Headless Chromium (Debian's,
through Playwright) opens the UI, screenshots the deployment, the schedule, the paused run, the Resume form with
the question and the answer chosen, submits the form, and the run must then complete having taken that answer.

The run is executed by ``prefect flow-run execute``: the process a process worker starts for a flow run (a
worker itself, polling, is test_deploy.py's; here it would add its start-up to the test for the same run).

The pictures go to a temporary folder; with ``DIFFPREP_UPDATE_SCREENSHOTS=1`` they replace docs/img/prefect-*.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

# Prefect's console log handler keeps the stream it finds when prefect is first imported (see test_deploy.py).
import diffprep.flows.validate  # noqa: F401

from diffprep import contract
from diffprep.config import load_settings
from diffprep.phases import pipeline
from diffprep.tools.demo import write_demo_dataset
from diffprep.validation import validate_dataset
from diffprep.writer.plan import read_plan
from prefect_cli import REPO, Process, run, shell_env, wait_for_state

# Read at collection: conftest removes every DIFFPREP_* variable before each test.
UPDATE = os.environ.get("DIFFPREP_UPDATE_SCREENSHOTS") == "1"
CHROMIUM = Path("/usr/bin/chromium")
DOCS_IMG = REPO / "docs" / "img"
PAGE = REPO / "docs" / "prefect-server.md"
SHOTS = ("prefect-deployment.png", "prefect-schedule.png", "prefect-paused-run.png", "prefect-answer.png",
         "prefect-completed-run.png")
MAX_BYTES = 200_000  # per picture: the docs are read on the forge too
RUN_NAME = "flux-48px"
POOL = "diffprep-gpu"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(url: str, server: Process, seconds: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert server.popen.poll() is None, f"prefect server start exited:\n{server.tail()}"
        assert time.monotonic() < deadline, f"no server after {seconds} s:\n{server.tail()}"
        time.sleep(0.5)


def _small(png: Path) -> None:
    """A screenshot as a 256-colour PNG: a UI's flat colours lose nothing a reader sees, the file a few times less."""
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def _choose(page, select, option: str) -> None:
    """Pick ``option`` in one of the UI's dropdowns: it opens from the keyboard (a click only focuses it here)."""
    select.focus()
    page.keyboard.press("ArrowDown")
    page.locator(".p-select-option", has_text=re.compile(rf"^\s*{re.escape(option)}\s*$")).click()


def _question_saved(client, flow_run_id) -> dict[str, str] | None:
    """The keys of the paused run's form (description, schema, response) once its question is saved, else None.

    The run is Paused a moment before its form and question are saved: the UI shows the form only after.
    """
    import httpx

    flow_run = client.read_flow_run(flow_run_id)
    if flow_run.state is None or not flow_run.state.is_paused():
        return None
    keys = flow_run.state.state_details.run_input_keyset or {}
    try:
        return keys if keys and client.read_flow_run_input(flow_run_id, keys["description"]) else None
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 404:
            return None
        raise


def test_the_pictures_the_page_shows_are_the_ones_this_test_takes():
    shown = set(re.findall(r"\]\(img/(prefect-[\w-]+\.png)\)", PAGE.read_text()))
    assert shown == set(SHOTS), f"docs/prefect-server.md shows {sorted(shown)}; the test takes {SHOTS}"
    for name in SHOTS:
        assert (DOCS_IMG / name).is_file(), (f"docs/img/{name} is missing: take the pictures with "
                                             "DIFFPREP_UPDATE_SCREENSHOTS=1 pytest tests/test_docs_prefect_ui.py")
        assert (DOCS_IMG / name).stat().st_size < MAX_BYTES, name


@pytest.fixture
def short_dir():
    """A folder with a short path: the question in the pictures names the output's path."""
    path = Path(tempfile.mkdtemp(prefix="encoded-"))
    yield path
    shutil.rmtree(path)


def test_an_approval_answered_in_the_ui_is_taken(tiny_model, tmp_path, short_dir):
    from playwright.sync_api import expect, sync_playwright
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does it)"
    shots = DOCS_IMG if UPDATE else tmp_path / "img"
    shots.mkdir(parents=True, exist_ok=True)

    # The server as the page starts it: the UI on a port of its own calls the API named by PREFECT_UI_API_URL.
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = shell_env(f"{url}/api", tmp_path / "prefect-home")
    server = Process(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                     env | {"PREFECT_UI_API_URL": f"{url}/api", "PREFECT_UI_URL": url}, tmp_path,
                     tmp_path / "server.log")
    executor = None
    try:
        # Meanwhile, the dataset a first run wrote at 32 px (in this process, no server needed).
        data = write_demo_dataset(tmp_path / "data", samples=4)
        out = short_dir / "my-dataset"
        given = {
            "source": {"type": "directory", "input_dir": str(data)},
            "output": {"output_dir": str(out), "shard_size": 4, "approval_timeout": 300},
            "model": {"model_path": str(tiny_model), "precision": "fp32", "device": "cpu", "batch_size": 4,
                      "t5_max_length": 16, "min_psnr": 0.0},  # the tiny VAE cannot reconstruct images
            "image": {"image_size": 32, "decode_workers": 1},
        }
        first = pipeline.run(load_settings(overrides=given), contract.ENCODING_PREENCODED)
        assert first.action == "fresh" and first.samples == 4
        _wait_healthy(url, server)

        run(["prefect", "work-pool", "create", POOL, "--type", "process"], env, REPO)
        run(["prefect", "--no-prompt", "deploy", "--all"], env, REPO)
        given["image"]["image_size"] = 48
        with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("encode-dataset/default")
            nightly = client.read_deployment_by_name("encode-dataset/nightly-append")
            flow_run = client.create_flow_run_from_deployment(deployment.id, name=RUN_NAME,
                                                              parameters={"parameters": given})
            # With the work pool's job variables in its environment, as a process worker starts it.
            executor = Process(["prefect", "flow-run", "execute", str(flow_run.id)],
                               env | deployment.job_variables.get("env", {}), tmp_path, tmp_path / "flow-run.log")
            deadline = time.monotonic() + 120
            while (keys := _question_saved(client, flow_run.id)) is None:
                assert executor.popen.poll() is None, f"the run ended without asking:\n{executor.tail()}"
                assert time.monotonic() < deadline, f"no question after 120 s:\n{executor.tail()}"
                time.sleep(0.5)

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(30_000)

            def shot(name: str, graph: bool = False) -> None:
                page.wait_for_load_state("networkidle")
                if graph:
                    page.wait_for_timeout(1500)  # not a check: the run graph (a canvas) animates into its layout
                page.screenshot(path=shots / name)
                _small(shots / name)

            page.goto(f"{url}/deployments/deployment/{deployment.id}")
            expect(page.get_by_text(RUN_NAME)).to_be_visible()
            expect(page.get_by_text("Paused", exact=True).first).to_be_visible()
            shot("prefect-deployment.png")

            page.goto(f"{url}/deployments/deployment/{nightly.id}")
            expect(page.get_by_text("At 02:00 AM every day")).to_be_visible()
            shot("prefect-schedule.png")

            page.goto(f"{url}/runs/flow-run/{flow_run.id}")
            expect(page.get_by_text("Paused", exact=True).first).to_be_visible()
            # The newest log lines first: the question's line comes into the picture under the run's header.
            _choose(page, page.get_by_role("button", name="Oldest to newest"), "Newest to oldest")
            expect(page.get_by_text(re.compile("waiting up to 300 s for an answer in the Prefect UI"))).to_be_visible()
            shot("prefect-paused-run.png", graph=True)

            page.get_by_role("button", name="Resume").click()
            dialog = page.get_by_role("dialog")
            expect(dialog.get_by_text("image.image_size: 32 -> 48")).to_be_visible()
            _choose(page, dialog.locator(".p-select-button__control"), "overwrite")
            expect(dialog.locator(".p-select-button__value")).to_have_text("overwrite")
            shot("prefect-answer.png", graph=True)
            dialog.get_by_role("button", name="Submit").click()

            with temporary_settings({PREFECT_API_URL: f"{url}/api"}):
                finished = wait_for_state(flow_run.id, lambda state: state.is_final(), 120, executor)
                assert finished.state.is_completed(), f"{finished.state}:\n{executor.tail()}"
                with get_client(sync_client=True) as client:
                    response = json.loads(client.read_flow_run_input(flow_run.id, keys["response"]))
            page.goto(f"{url}/runs/flow-run/{flow_run.id}")
            expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
            shot("prefect-completed-run.png", graph=True)
            browser.close()
        executor.popen.wait(timeout=60)
        assert executor.popen.returncode == 0, executor.tail()
    finally:
        for process in (executor, server):
            if process is not None:
                process.stop()

    # The UI's form sent the answer chosen in it, and the run took it: the 32 px output was overwritten in place.
    assert response == {"answer": "overwrite"}, response
    plan = read_plan(out)
    assert plan.settings["image"]["image_size"] == 48 and plan.expected["latents"] == [16, 6, 6]
    assert validate_dataset(out).ok
    assert not out.with_name("my-dataset-v2").exists()
    for name in SHOTS:
        assert (shots / name).stat().st_size < MAX_BYTES, f"{name}: {(shots / name).stat().st_size} bytes"
