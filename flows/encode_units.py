"""The encode-units flow: encode a list of units of a planned output (the fan-out target on pool workers)."""

from __future__ import annotations

from prefect import flow

from diffprep.run.allocator import tune_malloc
from diffprep.config import Settings
from diffprep.output import OutputRef
from diffprep.phases.pipeline import text_scratch
from diffprep.flows.runners import ArtifactProgress, run_units
from diffprep.tasks.common import output_of


@flow(name="encode-units", log_prints=True)
def encode_units(output: OutputRef, settings: dict, units: list[int]) -> dict:
    """Encode ``units`` of the plan in ``output`` (written by encode-dataset) with ``settings``.

    Units already committed are skipped, so a re-sent chunk only finishes what is left.
    """
    tune_malloc()  # a work-pool worker's flow process: before the encoders load (diffprep/run/allocator.py)
    s = Settings(**settings)
    if s.workers.deployment:
        raise ValueError("encode-units runs its units here: workers.deployment must be unset")
    out = output_of(output)
    out.clear_dead_temp_files()
    plan = out.state.plan()
    try:
        run_units(s, out, plan, list(units), ArtifactProgress(len(units), key=None))
    finally:  # this machine's part of the shared captions, for a staging folder of its own (the encode-dataset
        # run that sent the chunk removes the whole folder once every unit is done)
        out.state.discard_scratch(text_scratch(plan, this_host=True))
    return {"units": list(units)}
