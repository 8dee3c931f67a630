"""The validate-dataset flow: strict validation of a finished output, as a run with a report.

The same checks as the last phase of encode-dataset and ``diffprep validate``
(diffprep.validate), for a dataset finalized earlier or copied elsewhere. The
report is a Markdown artifact whether the checks pass or fail; a failure fails
the run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from prefect import flow, get_run_logger
from pydantic import Field

from diffprep.config import AuthConfig, OutputConfig, Settings
from tasks.common import output_from
from tasks.validate import validate_task


@flow(name="validate-dataset", log_prints=True)
def validate_dataset_flow(
    out_dir: str,
    encoding: Literal["preencoded", "raw"] | None = None,
    max_load: Annotated[int, Field(ge=1)] | None = None,
    s3_endpoint_url: str | None = None,
    aws_credentials_block: str | None = None,
) -> dict:
    """Validate a finalized diffprep dataset through Energon's own loader.

    Args:
        out_dir: the dataset folder (holds .nv-meta/) on the machine that runs the flow, or s3://bucket/prefix
            (validated in place, read back from the bucket).
        encoding: fail unless dataset.yaml declares this encoding; unset: the one it declares.
        max_load: load at most this many samples per split (counts are still checked from the tar headers);
            unset: every sample.
        s3_endpoint_url: for s3://: the endpoint of a non-AWS store; unset: AWS, or AWS_ENDPOINT_URL.
        aws_credentials_block: for s3://: a saved diffprep S3 credentials block; unset: the AWS chain.
    """
    logger = get_run_logger()
    settings = Settings(output=OutputConfig(output_dir=out_dir, s3_endpoint_url=s3_endpoint_url),
                        auth=AuthConfig(aws_credentials_block=aws_credentials_block))
    out_dir = output_from(settings).uri
    # publishes the report, passed or failed
    result = validate_task(out_dir, encoding, max_load, settings=settings.model_dump(mode="json"))
    summary = result["summary"]
    logger.info("validation of %s passed: %s samples in %s shards", out_dir, summary.get("samples"),
                summary.get("shards"))
    return {"out_dir": out_dir, "ok": result["ok"], "summary": summary}
