"""configs/prefect/k8s-work-pool.json and configs/prefect/prefect-k8s.yaml against a real Prefect server (no cluster).

The pool is created with the Prefect CLI as the README says, the deployments
with ``prefect deploy --prefect-file``; a flow run's Kubernetes Job is then
rendered the way the Kubernetes worker renders it before submitting
(``KubernetesWorkerJobConfiguration.resolve_for_flow_run``: pool template +
deployment job variables + run job variables, then ``prepare_for_flow_run``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from prefect_cli import REPO, run, shell_env

TEMPLATE = REPO / "configs" / "prefect" / "k8s-work-pool.json"
PREFECT_FILE = REPO / "configs" / "prefect" / "prefect-k8s.yaml"
POOL = "diffprep-k8s"  # the pool configs/prefect/prefect-k8s.yaml deploys to
# What encode-dataset sends an encode-units run (the run is rendered, never executed).
UNITS_PARAMETERS = {"output": {"location": "s3://datasets/encoded/my-dataset"}, "settings": {}, "units": [0, 1]}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(prefect_server, tmp_path_factory) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return shell_env(PREFECT_API_URL.value(), tmp_path_factory.mktemp("prefect-home"))


@pytest.fixture(scope="module")
def deployed(env) -> None:
    run(["prefect", "work-pool", "create", POOL, "--type", "kubernetes", "--base-job-template", str(TEMPLATE)], env)
    run(["prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE)], env)


def _container(configuration) -> dict:
    [container] = configuration.job_manifest["spec"]["template"]["spec"]["containers"]
    return container


def _rendered(deployment_name: str, **job_variables):
    """The job configuration the Kubernetes worker would submit for a new run of ``deployment_name``."""
    from prefect.client.orchestration import get_client
    from prefect_kubernetes.worker import KubernetesWorker

    async def render():
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(deployment_name)
            flow_run = await client.create_flow_run_from_deployment(
                deployment.id, parameters=UNITS_PARAMETERS, job_variables=job_variables)
            pool = await client.read_work_pool(deployment.work_pool_name)
            return await KubernetesWorker.job_configuration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pool, worker_name="test-render", deployment=deployment)

    return asyncio.run(render())


def test_the_template_is_the_kubernetes_default_plus_gpus():
    """Every variable and job setting of prefect-kubernetes' own default stays: only additions."""
    from prefect_kubernetes.worker import KubernetesWorker

    ours = json.loads(TEMPLATE.read_text())
    default = KubernetesWorker.get_default_base_job_template()
    assert set(default["variables"]["properties"]) <= set(ours["variables"]["properties"])
    assert set(default["job_configuration"]) == set(ours["job_configuration"])
    assert ours["variables"]["properties"]["gpu_count"]["default"] == 1


def test_the_server_accepts_the_template_and_refuses_a_broken_one(deployed, env, tmp_path):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(POOL)
    assert pool.type == "kubernetes"
    assert pool.base_job_template == json.loads(TEMPLATE.read_text())

    # The same file with a placeholder that names no variable: the server refuses it (the check is real).
    broken = json.loads(TEMPLATE.read_text())
    broken["variables"]["properties"].pop("gpu_count")
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    done = run(["prefect", "work-pool", "create", "diffprep-k8s-broken", "--type", "kubernetes",
                "--base-job-template", str(tmp_path / "broken.json")], env, check=False)
    assert done.returncode != 0
    assert "gpu_count" in done.stdout + done.stderr


def test_an_encode_units_run_requests_its_gpus(deployed):
    configuration = _rendered("encode-units/k8s")
    container = _container(configuration)
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}
    assert container["image"] == "registry.example.com/diffprep:0.1.0"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "diffprep"
    assert env["PREFECT__FLOW_RUN_ID"]  # prepare_for_flow_run ran: the pod executes this run
    pod = configuration.job_manifest["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert configuration.job_manifest["metadata"]["labels"]["prefect.io/deployment-name"] == "k8s"


def test_job_variables_of_the_deployment_and_the_run_set_the_gpu_count(deployed):
    node = _container(_rendered("encode-units/k8s-node"))
    assert node["resources"]["limits"] == {"nvidia.com/gpu": 8} == node["resources"]["requests"]

    given = _rendered("encode-units/k8s", gpu_count=2, cpu_request="8", memory_limit="64Gi")
    assert _container(given)["resources"] == {"limits": {"nvidia.com/gpu": 2, "memory": "64Gi"},
                                              "requests": {"nvidia.com/gpu": 2, "cpu": "8"}}


def test_the_server_refuses_a_negative_gpu_count(deployed):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("encode-units/k8s")
        with pytest.raises(PrefectHTTPStatusError, match="gpu_count"):
            client.create_flow_run_from_deployment(deployment.id, parameters=UNITS_PARAMETERS,
                                                   job_variables={"gpu_count": -1})
