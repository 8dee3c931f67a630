"""The encode-units flow: encode a list of units of a planned output (the fan-out target on pool workers)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from diffprep.allocator import tune_malloc
from diffprep.config import Settings
from diffprep.existing import clear_dead_temp_files
from flows.runners import RUNNERS, Progress, runner_for
from tasks.common import output_from


@flow(name="encode-units", log_prints=True)
def encode_units(out_dir: str, settings: dict, units: list[int]) -> dict:
    """Encode ``units`` of the plan in ``out_dir`` (written by encode-dataset) with ``settings``.

    Units already committed are skipped, so a re-sent chunk only finishes what is left.
    """
    tune_malloc()  # a work-pool worker's flow process: before the encoders load (diffprep/allocator.py)
    s = Settings(**settings)
    if s.workers.deployment:
        raise ValueError("encode-units runs its units here: workers.deployment must be unset")
    output = output_from(s, out_dir)
    output.pull_state()  # a bucket output: this machine's staging folder gets the run's plan
    clear_dead_temp_files(output.local)
    runner = runner_for(s)
    get_run_logger().info("encoding %d units with the %s runner", len(units), runner)
    RUNNERS[runner](s, settings, out_dir, list(units), Progress(len(units), key=None))
    return {"units": list(units)}
