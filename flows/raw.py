"""The encode-raw flow: prepared images and captions stored as files, for encoding at training time.

The same phases as encode-dataset (``flows.encode.run_pipeline``: verify,
approvals, lock, audit, finalize, validate, artifacts) with a raw plan, a
one-batch check without encoders, and units written in the flow's process
(the work is image decoding and compression, not a device).
"""

from __future__ import annotations

from prefect import flow

from diffprep import contract
from diffprep.config import RawParameters, Settings, check_runnable, load_settings
from flows.encode import Pipeline, run_pipeline
from flows.runners import Progress
from tasks.raw import fetch_raw_task, raw_sanity_task, raw_unit_task


def write_raw_units(settings: Settings, params: dict, out_dir: str, units: list[int], progress: Progress) -> None:
    for unit in units:
        progress.unit_done(raw_unit_task(params, out_dir, unit))


RAW_PIPELINE = Pipeline(contract.ENCODING_RAW, fetch_raw_task, raw_sanity_task, write_raw_units)


@flow(name="encode-raw", log_prints=True)
def encode_raw(parameters: RawParameters | None = None) -> dict:
    """Store a source's images (resized, as jpg, png or webp) and captions as a validated Energon dataset.

    Existing data is changed only after an approval, as in encode-dataset.

    Args:
        parameters: The run's settings by section. Only the fields given count; the rest comes from the
            config file (``config``), the ``DIFFPREP_*`` environment of the worker, and the defaults.
    """
    parameters = parameters or RawParameters()
    settings = load_settings(parameters.config, parameters.overrides())
    check_runnable(settings)
    return run_pipeline(settings, RAW_PIPELINE)
