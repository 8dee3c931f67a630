"""Task: strict validation of the finished dataset (diffprep.validation); a failure fails the run.

The report is published as a Markdown artifact whether the checks pass or fail.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from diffprep.output import OutputRef
from diffprep.validation import ValidationReport, validate_dataset
from diffprep.tasks.common import output_of, slug


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_task(output: OutputRef, encoding: str | None = None, max_load: int | None = None, full: bool = False,
                  workers: int = 1) -> ValidationReport:
    report = validate_dataset(output_of(output), encoding=encoding, max_load=max_load, full=full, workers=workers)
    create_markdown_artifact(key=f"validation-{slug(output.location)}", markdown=report.to_markdown(pictures=True),
                             description="diffprep validation report" + ("" if report.ok else " (FAILED)"))
    report.raise_if_failed()
    return report
