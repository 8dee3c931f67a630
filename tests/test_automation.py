"""The "a run waits for an answer" automation against a real Prefect server: created, fired, delivered.

The session's test server (prefect_test_harness) runs the event services an
automation needs (triggers, actions) in its subprocess. The notification block
is a custom webhook pointed at an HTTP server this test runs on 127.0.0.1; the
server's actions service posts to it when a run pauses or is suspended. The
link to the run needs PREFECT_UI_URL in the server's environment, which the
harness does not set: one test starts ``prefect server start`` with it.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

# Prefect's console log handler keeps the stream it finds when prefect is first imported (see test_deploy.py).
import diffprep.flows.validate  # noqa: F401

from diffprep.errors import ConfigError
from diffprep.flows.automations import (ASKING_FLOWS, AUTOMATION_NAME, approval_automation, cmd_automation_create,
                               create_approval_automation)
from prefect_cli import REPO, Process, run, shell_env
from suspend_flow import QUESTION, units_then_question

BLOCK = "approval-hook"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def webhook():
    """An HTTP server on 127.0.0.1 that queues the JSON body of every POST it receives."""
    received: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            received.put(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def automation(prefect_server, webhook):
    """The automation for the test flow's runs, sending through a saved custom webhook block."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    url, _ = webhook
    CustomWebhookNotificationBlock(
        name="diffprep test", url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"},
        allow_private_urls=True,  # Prefect refuses loopback and private addresses unless told
    ).save(BLOCK, overwrite=True)
    created = create_approval_automation(BLOCK, flows=[units_then_question.name])
    time.sleep(2)  # the triggers service loads new automations
    return created


def _notification(received: queue.Queue, run_name: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            message = received.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no notification for {run_name} within {seconds} s")
        if run_name in message["subject"]:
            return message


def test_the_config_file_is_the_code_definition():
    from prefect.events.schemas.automations import AutomationCore

    block_id = uuid.UUID(int=0)
    shipped = yaml.safe_load((REPO / "configs" / "prefect" / "automation-approval.yaml").read_text())
    from_file = AutomationCore.model_validate(shipped)
    from_code = AutomationCore.model_validate(approval_automation(block_id).model_dump(exclude={"id"}))
    assert from_file == from_code


def test_the_automation_watches_the_flows_that_ask():
    from diffprep.flows.encode import encode_dataset
    from diffprep.flows.raw import encode_raw

    assert set(ASKING_FLOWS) == {encode_dataset.name, encode_raw.name}


def test_a_paused_run_is_notified_with_its_question_and_link(automation, webhook, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.flow_runs import resume_flow_run

    _, received = webhook
    name = f"notify-{uuid.uuid4().hex[:8]}"
    results: list = []
    thread = threading.Thread(target=lambda: results.append(units_then_question.with_options(flow_run_name=name)(
        str(tmp_path), timeout=120)), daemon=True)
    thread.start()
    try:
        message = _notification(received, name)
    finally:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 60
            while thread.is_alive() and time.monotonic() < deadline:
                [flow_run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
                details = flow_run.state.state_details
                if flow_run.state.is_paused() and details.run_input_keyset:
                    try:
                        resume_flow_run(flow_run.id, run_input={"answer": "accept"})
                        break
                    except RuntimeError:  # the form is saved a moment after the state
                        pass
                time.sleep(0.5)
        thread.join(60)
    assert results == ["accept"]
    assert message["subject"] == f"diffprep: {name} waits for an answer"
    assert message["body"].startswith(f"{QUESTION.title} (question: {QUESTION.key})")
    assert f"The run {name} is Paused until someone answers" in message["body"]
    # The test harness's server has no PREFECT_UI_URL: the run's id instead of a link (the link: below).
    assert f"flow run {flow_run.id} (no link: set PREFECT_UI_URL where the server runs)" in message["body"]


def test_a_suspended_run_is_notified(automation, webhook):
    """The server's event for a run entering Suspended (tests/test_suspend.py suspends a real one)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Suspended

    _, received = webhook
    name = f"suspended-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(units_then_question, name=name, parameters={"work_dir": "/nowhere"})
        client.update_flow_run_labels(flow_run.id, {"diffprep.question": "Overwrite 3 shards?",
                                                    "diffprep.question-key": "existing-output"})
        client.set_flow_run_state(flow_run.id, Suspended(timeout_seconds=60, pause_key="existing-output"), force=True)
    message = _notification(received, name)
    assert message["body"].startswith("Overwrite 3 shards? (question: existing-output)")
    assert f"The run {name} is Suspended" in message["body"]


def test_other_flows_do_not_notify(automation, webhook):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Paused

    @flow(name="not-diffprep")
    def other() -> None:
        pass

    _, received = webhook
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(other, name="not-diffprep-run")
        client.set_flow_run_state(flow_run.id, Paused(timeout_seconds=60, pause_key="x"), force=True)
    with pytest.raises(pytest.fail.Exception, match="no notification"):
        _notification(received, "not-diffprep-run", seconds=10)


def test_the_cli_creates_it_from_the_config_file(automation, tmp_path):
    """``prefect automation create --from-file`` accepts the shipped file once its block id is filled in."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    definition = yaml.safe_load((REPO / "configs" / "prefect" / "automation-approval.yaml").read_text())
    definition["name"] = "diffprep approval from the file"
    definition["actions"][0]["block_document_id"] = str(automation.actions[0].block_document_id)
    (tmp_path / "automation.yaml").write_text(yaml.safe_dump(definition))
    env = shell_env(PREFECT_API_URL.value(), tmp_path / "home")
    run(["prefect", "automation", "create", "--from-file", str(tmp_path / "automation.yaml")], env, cwd=tmp_path)
    with get_client(sync_client=True) as client:
        [created] = client.read_automations_by_name("diffprep approval from the file")
        client.delete_automation(created.id)
    expected = approval_automation(automation.actions[0].block_document_id)
    assert created.trigger.model_dump(exclude={"id"}) == expected.trigger.model_dump(exclude={"id"})
    assert created.actions == expected.actions


def test_creating_it_again_replaces_it_and_a_wrong_block_is_named(automation, capsys):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert cmd_automation_create(BLOCK) == 0
    assert f"created automation '{AUTOMATION_NAME}'" in capsys.readouterr().out
    with get_client(sync_client=True) as client:
        [replaced] = client.read_automations_by_name(AUTOMATION_NAME)
    assert replaced.id != automation.id
    again = create_approval_automation(BLOCK, flows=[units_then_question.name])  # back to the test flow's
    with get_client(sync_client=True) as client:
        assert [a.id for a in client.read_automations_by_name(AUTOMATION_NAME)] == [again.id]
    with pytest.raises(ConfigError, match=f"no notification block named 'nope'.*custom-webhook/{BLOCK}"):
        create_approval_automation("nope")
    with temporary_settings(restore_defaults={PREFECT_API_URL}), pytest.raises(ConfigError, match="PREFECT_API_URL"):
        create_approval_automation(BLOCK)
    time.sleep(2)  # the replacement is loaded before later tests pause runs


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """``prefect server start`` on a free loopback port, with PREFECT_UI_URL set as the README says; stopped after."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = tmp_path_factory.mktemp("ui-server")
    url = f"http://127.0.0.1:{port}"
    env = shell_env(f"{url}/api", home) | {"PREFECT_UI_URL": url}
    server = Process(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"], env, home,
                     home / "server.log")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.popen.poll() is None, f"prefect server start exited:\n{server.tail()}"
            assert time.monotonic() < deadline, f"no server after 120 s:\n{server.tail()}"
            time.sleep(1)
        yield url
    finally:
        server.stop()


def test_with_prefect_ui_url_on_the_server_the_message_links_the_run(ui_server, webhook):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Suspended

    hook, received = webhook
    name = f"linked-{uuid.uuid4().hex[:8]}"
    with temporary_settings({PREFECT_API_URL: f"{ui_server}/api"}):
        CustomWebhookNotificationBlock(name="diffprep test", url=hook, allow_private_urls=True,
                                       json_data={"subject": "{{subject}}", "body": "{{body}}"}).save(BLOCK)
        create_approval_automation(f"custom-webhook/{BLOCK}", flows=[units_then_question.name])
        time.sleep(2)  # the triggers service loads new automations
        with get_client(sync_client=True) as client:
            flow_run = client.create_flow_run(units_then_question, name=name, parameters={"work_dir": "/nowhere"})
            client.update_flow_run_labels(flow_run.id, {"diffprep.question": "Accept 2 rejected samples?",
                                                        "diffprep.question-key": "rejects"})
            client.set_flow_run_state(flow_run.id, Suspended(timeout_seconds=60, pause_key="rejects"), force=True)
    message = _notification(received, name)
    assert message["body"].startswith("Accept 2 rejected samples? (question: rejects)")
    assert f"\n{ui_server}/runs/flow-run/{flow_run.id}\n" in message["body"], message["body"]
