"""The validate-dataset flow: strict validation of a finished output, as a run with a report.

The same checks as the last phase of encode-dataset and ``diffprep validate``
(diffprep.validate), for a dataset finalized earlier or copied elsewhere. The
report is a Markdown artifact whether the checks pass or fail; a failure fails
the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger
from pydantic import Field

from tasks.validate import validate_task


@flow(name="validate-dataset", log_prints=True)
def validate_dataset_flow(
    out_dir: str,
    encoding: Literal["preencoded", "raw"] | None = None,
    max_load: Annotated[int, Field(ge=1)] | None = None,
) -> dict:
    """Validate a finalized diffprep dataset through Energon's own loader.

    Args:
        out_dir: the dataset folder (holds .nv-meta/), on the machine that runs the flow.
        encoding: fail unless dataset.yaml declares this encoding; unset: the one it declares.
        max_load: load at most this many samples per split (counts are still checked from the tar headers);
            unset: every sample.
    """
    logger = get_run_logger()
    out_dir = str(Path(out_dir).expanduser().resolve())
    result = validate_task(out_dir, encoding, max_load)  # publishes the report, passed or failed
    summary = result["summary"]
    logger.info("validation of %s passed: %s samples in %s shards", out_dir, summary.get("samples"),
                summary.get("shards"))
    return {"out_dir": out_dir, "ok": result["ok"], "summary": summary}
