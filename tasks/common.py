"""What every task shares: the output a reference names, the Hugging Face token, which errors a retry can help."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffprep.config import Settings
from diffprep.output import Output, OutputRef


def settings_from(params: dict[str, Any] | Settings) -> Settings:
    """The run's settings from the dict a deployment passed (every field explicit: env and YAML do not apply)."""
    return params if isinstance(params, Settings) else Settings(**params)


def run_token(settings: Settings) -> str | None:
    """The Hugging Face token: a credentials block by name, else the token file / HF_TOKEN / cached login."""
    from diffprep.families.hub import resolve_token

    if settings.auth.hf_credentials_block:
        from diffprep.blocks.hf_credentials import HuggingFaceCredentials

        return HuggingFaceCredentials.load(settings.auth.hf_credentials_block).token.get_secret_value()
    return resolve_token(settings.auth.hf_token_file)


def output_of(ref: OutputRef) -> Output:
    """The output ``ref`` names, opened once per process; a named S3 credentials block is loaded for it."""
    credentials = None
    if ref.credentials_block:
        from diffprep.blocks.aws_credentials import AwsS3Credentials

        credentials = AwsS3Credentials.load(ref.credentials_block).environment()
    return ref.open(credentials)


# How often, and after how many seconds, a phase is tried again after a transient error (the tasks' retries; a
# terminal run without a server retries the same way: flows/recorded.py).
FETCH_RETRY_DELAYS = (5, 30, 120)
UNIT_RETRY_DELAYS = (10, 60)


def is_transient(exc: BaseException) -> bool:
    """Network and storage hiccups: worth a retry. Bad settings and bad samples are not."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is None or status >= 500 or status == 429
    return isinstance(exc, (ConnectionError, TimeoutError))


def retry_transient(task, task_run, state) -> bool:
    """``retry_condition_fn`` for Prefect tasks: retry only transient errors."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - inspecting the failure
        return is_transient(exc)
    return False


def slug(path: str) -> str:
    """An artifact key from an output path or URL: lowercase letters, digits and dashes."""
    name = "".join(c if c.isalnum() else "-" for c in Path(path.rstrip("/")).name.lower()).strip("-")
    return (name or "output")[:40]


def small(value: Any) -> Any:
    """A JSON round trip: task results stay plain data (paths and summaries, never tensors)."""
    return json.loads(json.dumps(value))
