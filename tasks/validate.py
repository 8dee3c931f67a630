"""Task: strict validation of the finished dataset (diffprep.validate); a failure fails the run.

The report is published as a Markdown artifact whether the checks pass or fail.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from diffprep.validate import validate_dataset
from diffprep.outputs import open_output
from tasks.common import output_from, settings_from, slug, small


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_task(out_dir: str, encoding: str | None = None, max_load: int | None = None,
                  settings: dict | None = None) -> dict:
    """``settings``: the run's, for an s3:// output's endpoint, profile and credentials block."""
    output = output_from(settings_from(settings), out_dir) if settings else open_output(out_dir)
    report = validate_dataset(output, encoding=encoding, max_load=max_load)
    create_markdown_artifact(key=f"validation-{slug(out_dir)}", markdown=report.to_markdown(pictures=True),
                             description="diffprep validation report" + ("" if report.ok else " (FAILED)"))
    report.raise_if_failed()
    return small(report.to_json()) | {"markdown": report.to_markdown()}
