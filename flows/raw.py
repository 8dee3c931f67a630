"""The encode-raw flow: prepared images (or, with resolution buckets, bucketed clips as mp4) and captions stored as
files, for encoding at training time.

The same phases as encode-dataset (verify, approvals, lock, audit, finalize,
validate, artifacts) with the raw encoding: a one-batch check without
encoders, units written in the flow's process (the work is image decoding
and compression, not a device).
"""

from __future__ import annotations

from prefect import flow

from diffprep import contract
from diffprep.config import RawParameters, check_runnable, load_settings
from diffprep.phases.preflight import preflight
from diffprep.flows.encode import run_flow


@flow(name="encode-raw", log_prints=True)
def encode_raw(parameters: RawParameters | None = None) -> dict:
    """Store a source's images (resized, as jpg, png or webp) or, with ``video.resolution_buckets``, its clips
    (bucketed, as H.264 mp4 + json) and captions as a validated Energon dataset.

    Existing data is changed only after an approval, as in encode-dataset.

    Args:
        parameters: The run's settings by section. Only the fields given count; the rest comes from the
            config file (``config``), the ``DIFFPREP_*`` environment of the worker, and the defaults.
    """
    parameters = parameters or RawParameters()
    settings = load_settings(parameters.config, parameters.overrides())
    check_runnable(settings)
    preflight(settings, contract.ENCODING_RAW)  # before anything is written, the encoding's own checks too
    return run_flow(settings, contract.ENCODING_RAW)
