"""A terminal run's start-up, overlapped: the encoders load while the embedded Prefect server starts.

Before ``diffprep encode`` enters its flow, two slow things that do not depend
on each other start together: a thread imports the model classes (diffusers,
transformers) and loads the run's encoders into the process's cache (each
encoding loads once per process, so the sanity check and the units find them
there), while this thread starts the embedded Prefect server when no
``PREFECT_API_URL`` is set (the server the flow's first API call would start;
it is a singleton, so the flow then uses it; ``embedded_server.py`` starts it
in a session of its own, so that a Ctrl-C does not kill it). Measured in
``benchmarks/README.md`` (issue #17, start-up).

The plan phase, meanwhile, imports the same libraries to describe the encoders
(LTX-2: ltx-core's configurators, transformers' Gemma 3 classes). Every such
import goes through ``diffprep.families.imports.family_imports``, one lock
under which a family's modules are imported whole, once: whichever thread comes
first imports them, the other waits for that and finds them imported (two
threads importing transformers' lazy modules at once fail or hang: issue 35).

Nothing is loaded ahead when the settings need the Prefect API to be known (a
Hugging Face credentials block): the warming thread makes no API call. A
failure while warming is not reported here; the run meets it again in its own
phase, with its own message.

The terminal's console shows a ``DiffprepError`` (a bad setting, an empty
source, an output that needs an answer) as its message, without Prefect's
traceback: the command ends by printing it (``quiet_user_error_tracebacks``).
"""

from __future__ import annotations

import logging
import threading

from prefect.logging.configuration import ensure_logging_setup
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

from diffprep.config import Settings
from diffprep.errors import DiffprepError

log = logging.getLogger("diffprep.startup")


def warm_start(settings: Settings, kind: str) -> threading.Thread | None:
    """Load ``settings``' encoders in a thread and start the embedded server here; returns the thread (or None)."""
    thread = load_ahead(settings, kind)
    start_embedded_server()
    return thread


def load_ahead(settings: Settings, kind: str) -> threading.Thread | None:
    """Load ``settings``' encoders in a thread (None when that would need the Prefect API: a credentials block).

    The thread imports the family's libraries (transformers, diffusers, ltx-core) while this one goes on to the
    plan phase, which imports them too: both go through ``diffprep.families.imports.family_imports``, so that
    one imports them and the other waits (two threads importing them at once fail: issue 35). diffprep's own
    modules the thread needs are imported here, before it starts."""
    if settings.auth.hf_credentials_block:
        return None
    from diffprep.encodings import encoding_for, get_encoding
    from diffprep.families.hub import resolve_token

    def load() -> None:
        try:
            token = resolve_token(settings.auth.hf_token_file)
            get_encoding(encoding_for(settings, kind, token)).load(settings, token)
        except Exception as error:  # noqa: BLE001 - the run's own phases report it, with their messages
            log.debug("encoders not loaded ahead (%s: %s); the run loads them itself", type(error).__name__, error)

    thread = threading.Thread(target=load, name="diffprep-warm", daemon=True)
    thread.start()
    return thread


def start_embedded_server() -> None:
    """Without ``PREFECT_API_URL``: start the embedded server now, in a session of its own (a Ctrl-C reaches this
    process only, which then records the run as crashed on a server still up; ``embedded_server.py``)."""
    if not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        from diffprep.flows.embedded_server import start_detached_server

        start_detached_server()


class _UserErrorsWithoutTraceback(logging.Formatter):
    """The terminal's Prefect log lines, less the traceback of a ``DiffprepError`` and less its message after
    the first line: the command ends by printing it in full (a question refused without a terminal was printed
    three times: the flow's exception line, its final state, the error). Other exceptions keep theirs, and so
    does the run's log on the server."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.errors: list[str] = []  # the DiffprepError messages seen, which the command prints at its end

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info and isinstance(record.exc_info[1], DiffprepError)):
            return self._shortened(self.inner.format(record))
        self.errors.append(str(record.exc_info[1]))
        kept = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self._shortened(self.inner.format(record))
        finally:
            record.exc_info, record.exc_text = kept

    def _shortened(self, text: str) -> str:
        for error in self.errors:
            first, _, rest = error.partition("\n")
            at = text.find(first)
            if rest and at >= 0:
                return text[:at + len(first)] + " ... (in full below)"
        return text


def quiet_user_error_tracebacks() -> None:
    """This terminal's Prefect console handler formats through ``_UserErrorsWithoutTraceback``."""
    ensure_logging_setup()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter,
                                                                           _UserErrorsWithoutTraceback):
            handler.setFormatter(_UserErrorsWithoutTraceback(handler.formatter))


__all__ = ["load_ahead", "quiet_user_error_tracebacks", "start_embedded_server", "warm_start"]
