"""A terminal run's start-up, overlapped: the encoders load while the embedded Prefect server starts.

Before ``diffprep encode`` enters its flow, two slow things that do not depend
on each other start together: a thread imports the model classes (diffusers,
transformers) and loads the run's encoders into the process's cache (each
encoding loads once per process, so the sanity check and the units find them
there), while this thread starts the embedded Prefect server when no
``PREFECT_API_URL`` is set (the server the flow's first API call would start;
it is a singleton, so the flow then uses it). Measured in
``benchmarks/README.md`` (issue #17, start-up).

Nothing is loaded ahead when the settings need the Prefect API to be known (a
Hugging Face credentials block): the warming thread makes no API call. A
failure while warming is not reported here; the run meets it again in its own
phase, with its own message.
"""

from __future__ import annotations

import logging
import threading

from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

from diffprep.config import Settings

log = logging.getLogger("diffprep.startup")


def warm_start(settings: Settings, kind: str) -> threading.Thread | None:
    """Load ``settings``' encoders in a thread and start the embedded server here; returns the thread (or None)."""
    thread = None
    if not settings.auth.hf_credentials_block:
        thread = threading.Thread(target=_load_encoders, args=(settings, kind), name="diffprep-warm", daemon=True)
        thread.start()
    if not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        from prefect.server.api.server import SubprocessASGIServer

        SubprocessASGIServer().start()
    return thread


def _load_encoders(settings: Settings, kind: str) -> None:
    from diffprep.encodings import encoding_for, get_encoding
    from diffprep.hub import resolve_token

    try:
        token = resolve_token(settings.auth.hf_token_file)
        get_encoding(encoding_for(settings, kind, token)).load(settings, token)
    except Exception as error:  # noqa: BLE001 - the run's own phases report it, with their messages
        log.debug("encoders not loaded ahead (%s: %s); the run loads them itself", type(error).__name__, error)


__all__ = ["warm_start"]
