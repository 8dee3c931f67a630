"""What every task shares: settings in and out of parameters, which errors a retry can help."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffprep.config import Settings
from diffprep.outputs import Output, open_output


def settings_from(params: dict[str, Any]) -> Settings:
    """Rebuild the run's settings from the dict the flow passed (every field explicit: env and YAML do not apply)."""
    return Settings(**params)


def run_token(settings: Settings) -> str | None:
    """The Hugging Face token: a credentials block by name, else the token file / HF_TOKEN / cached login."""
    from diffprep.encoders import resolve_token

    if settings.auth.hf_credentials_block:
        from blocks.hf_credentials import HuggingFaceCredentials

        return HuggingFaceCredentials.load(settings.auth.hf_credentials_block).token.get_secret_value()
    return resolve_token(settings.auth.hf_token_file)


def apply_aws_credentials(settings: Settings) -> None:
    """The S3 credentials block named in the settings, if any, as this process's ``AWS_*`` variables."""
    if settings.auth.aws_credentials_block:
        import os

        from blocks.aws_credentials import AwsS3Credentials

        block = AwsS3Credentials.load(settings.auth.aws_credentials_block)
        os.environ.update(block.environment())


def output_from(settings: Settings, out_dir: str | None = None) -> Output:
    """The run's output (``out_dir``, default the settings'): a local folder or an s3:// prefix."""
    apply_aws_credentials(settings)
    return open_output(out_dir or settings.output.output_dir, endpoint_url=settings.output.s3_endpoint_url,
                       profile=settings.output.s3_profile)


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
