"""``OutputRef``: where an output lives, as a small serializable value that tasks take as a parameter; opening it.

A reference holds the location (a folder or ``s3://bucket/prefix``), the
store's endpoint and AWS profile, and the name of a saved S3 credentials
block; no secret. ``open()`` gives the ``Output``, one per process and
reference, so a run's tasks share one client and one staging folder;
``ref_of(output)`` is the reference of an open output. The library's phases
take an ``Output``, or a local folder's path (``as_output``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from diffprep.output.base import Output
from diffprep.output.s3 import S3Output
from diffprep.sources.storage import is_s3_url, parse_s3_url

_OPENED: dict[OutputRef, Output] = {}
_LOCK = threading.Lock()


class OutputRef(BaseModel):
    """Where an output is: location, endpoint, profile, credentials block (by name)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    location: str = Field(description="A folder, or s3://bucket/prefix.")
    endpoint_url: str | None = Field(None, description="s3://: endpoint of a non-AWS store; unset: AWS.")
    profile: str | None = Field(None, description="s3://: AWS profile; unset: the AWS chain.")
    credentials_block: str | None = Field(None, description="s3://: a saved diffprep S3 credentials block.")

    def with_location(self, location: str) -> OutputRef:
        """The same store, another location (``new-dir``: ``<out>-v2``)."""
        return self.model_copy(update={"location": location})

    def open(self, credentials: Mapping[str, str] | None = None) -> Output:
        """The output, made once per process; ``credentials`` (the ``AWS_*`` values its block holds) go into this
        process's environment before its first client is made (the S3 client and Energon's storage client read
        them)."""
        with _LOCK:
            opened = _OPENED.get(self)
            if opened is None:
                if credentials:
                    os.environ.update(credentials)
                opened = _OPENED[self] = open_output(self.location, endpoint_url=self.endpoint_url,
                                                     profile=self.profile)
                opened.credentials_block = self.credentials_block
                _OPENED.setdefault(ref_of(opened), opened)  # the same output by its normalized location
            else:
                opened.state.reopened()  # another task: others may have written since; the next read looks
            return opened


def ref_of(output: Output) -> OutputRef:
    """How a task names an open output (``OutputRef.open()`` gives it back)."""
    if isinstance(output, S3Output):
        return OutputRef(location=output.uri, endpoint_url=output.endpoint_url, profile=output.profile,
                         credentials_block=output.credentials_block)
    return OutputRef(location=output.uri)


def open_output(location: str | os.PathLike | Output, *, endpoint_url: str | None = None,
                profile: str | None = None) -> Output:
    """The ``Output`` for a local path or an ``s3://bucket/prefix`` URL (a new one on each call)."""
    if isinstance(location, Output):
        return location
    if is_s3_url(str(location)):
        return S3Output(parse_s3_url(str(location), "output.output_dir"), endpoint_url=endpoint_url, profile=profile)
    return Output(location)


def as_output(output: Output | str | os.PathLike) -> Output:
    """What the library's phases take: an ``Output``, or a local folder's path. A bare ``s3://`` string is
    refused: it would lose its endpoint and profile on the way; pass ``OutputRef(...).open()``."""
    if isinstance(output, Output):
        return output
    if is_s3_url(str(output)):
        raise TypeError(f"{output}: pass the Output (OutputRef(location=..., endpoint_url=...).open()), not the "
                        "bare URL, so its endpoint and profile travel with it")
    return Output(output)


__all__ = ["OutputRef", "as_output", "open_output", "ref_of"]
