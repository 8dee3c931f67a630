"""``diffprep serve``: the flows as deployments served from this one process, with no work pool or worker.

For a single machine: runs started from the UI, the CLI or Python execute here,
each in its own subprocess. The deployments are named ``encode-dataset/serve``
and ``validate-dataset/serve``, apart from the work-pool deployments of
``prefect.yaml`` (``.../default``), so serving never rewrites those. Serving
needs a Prefect server that outlives this process (``PREFECT_API_URL``): runs
are triggered from outside it.
"""

from __future__ import annotations

from prefect.deployments.runner import EntrypointType, RunnerDeployment

from diffprep.errors import ConfigError

DEPLOYMENT_NAME = "serve"
TAGS = ["diffprep", "serve"]


def served_deployments() -> list[RunnerDeployment]:
    """encode-dataset, encode-raw and validate-dataset as deployments of this process (no schedule)."""
    from diffprep.flows.encode import encode_dataset
    from diffprep.flows.raw import encode_raw
    from diffprep.flows.validate import validate_dataset_flow

    # Module paths (the packages are installed), so the runs find the flows whatever the current folder.
    return [
        flow.to_deployment(name=DEPLOYMENT_NAME, tags=TAGS, entrypoint_type=EntrypointType.MODULE_PATH)
        for flow in (encode_dataset, encode_raw, validate_dataset_flow)
    ]


def how_to_trigger(api_url: str, ui_url: str | None) -> str:
    """The lines printed at start: which deployments are served and three ways to start a run."""
    lines = [
        f"serving encode-dataset/{DEPLOYMENT_NAME} and validate-dataset/{DEPLOYMENT_NAME} "
        f"(Prefect API {api_url}); Ctrl+C stops serving.",
        "Start a run:",
    ]
    if ui_url:
        lines.append(f"  UI:     {ui_url}/deployments -> encode-dataset / {DEPLOYMENT_NAME} -> Run -> Custom run")
    lines += [
        f"  CLI:    prefect deployment run validate-dataset/{DEPLOYMENT_NAME} --param out_dir=/path/to/dataset",
        f"          prefect deployment run encode-dataset/{DEPLOYMENT_NAME} "
        """--params '{"parameters": {"config": "/path/to/config.yaml"}}'""",
        "  Python: from prefect.deployments import run_deployment",
        f'          run_deployment("encode-dataset/{DEPLOYMENT_NAME}", '
        'parameters={"parameters": {"source": {...}, "output": {...}}}, timeout=0)',
        "Runs execute on this machine; paths in parameters are paths here. A run waiting for an approval "
        "shows as Paused in the UI (Resume -> choose an answer).",
    ]
    return "\n".join(lines)


def serve_flows(limit: int | None = None) -> None:
    """Serve the deployments until interrupted; ``limit`` caps concurrent runs (1 on a single GPU)."""
    from prefect import serve
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    api_url = settings.api.url
    if not api_url:
        raise ConfigError(
            "diffprep serve needs a running Prefect server to take runs from: start one with "
            "`prefect server start` and set PREFECT_API_URL (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1 (concurrent runs), got {limit}")
    deployments = served_deployments()
    print(how_to_trigger(api_url, settings.ui_url), flush=True)
    serve(*deployments, limit=limit, print_starting_message=False)
