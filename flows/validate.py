"""The validate-dataset flow: strict validation of a finished output, as a run with a report.

The same checks as the last phase of encode-dataset and ``diffprep validate``
(diffprep.validation), for a dataset finalized earlier or copied elsewhere. The
report is a Markdown artifact whether the checks pass or fail; a failure fails
the run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from prefect import flow, get_run_logger
from pydantic import Field

from diffprep import contract
from diffprep.output import OutputRef, ref_of
from diffprep.tasks.common import output_of
from diffprep.tasks.validate import validate_task


@flow(name="validate-dataset", log_prints=True)
def validate_dataset_flow(
    out_dir: str,
    encoding: Literal[contract.ENCODINGS] | None = None,  # every encoding, a dropdown in the UI
    max_load: Annotated[int, Field(ge=1)] | None = None,
    full: bool = False,
    workers: Annotated[int, Field(ge=1)] = 1,
    s3_endpoint_url: str | None = None,
    aws_credentials_block: str | None = None,
) -> dict:
    """Validate a finalized diffprep dataset through Energon's own loader.

    Args:
        out_dir: the dataset folder (holds .nv-meta/) on the machine that runs the flow, or s3://bucket/prefix
            (validated in place, read back from the bucket).
        encoding: fail unless dataset.yaml declares this encoding; unset: the one it declares.
        max_load: load at most this many samples per split (counts are still checked from the tar headers);
            unset: one sample drawn from each shard, or every sample with ``full``.
        full: load every sample (default: one drawn from each shard; every shard's headers, count and digest are
            checked either way).
        workers: with ``full``, load in this many processes (the report is the same).
        s3_endpoint_url: for s3://: the endpoint of a non-AWS store; unset: AWS, or AWS_ENDPOINT_URL.
        aws_credentials_block: for s3://: a saved diffprep S3 credentials block; unset: the AWS chain.
    """
    output = output_of(OutputRef(location=out_dir, endpoint_url=s3_endpoint_url,
                                 credentials_block=aws_credentials_block))
    report = validate_task(ref_of(output), encoding, max_load, full, workers)  # publishes the report, passed or failed
    summary = report.summary
    get_run_logger().info("validation of %s passed: %s samples in %s shards", output.uri, summary.get("samples"),
                          summary.get("shards"))
    return {"out_dir": output.uri, "ok": report.ok, "summary": summary}
