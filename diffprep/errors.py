"""Errors that reach the user: each says what went wrong and what to do about it."""

from __future__ import annotations


class DiffprepError(Exception):
    """Base class for errors a user can act on; the message names the fix."""


class ConfigError(DiffprepError):
    """A setting is missing, unknown or out of range."""


class SourceError(DiffprepError):
    """The source cannot be opened or listed (a missing folder, an empty glob...)."""


class AuthError(DiffprepError):
    """An encoder download was refused for lack of credentials."""


class OfflineError(DiffprepError):
    """An encoder is not in the Hugging Face cache and the hub cannot be reached (offline, or HF_HUB_OFFLINE)."""

    def __init__(self, message: str, *, encoder: str, repo_id: str, revision: str | None) -> None:
        super().__init__(message)
        self.encoder, self.repo_id, self.revision = encoder, repo_id, revision


class ExistingOutputError(DiffprepError):
    """The output holds data this run would change, and no approval was given."""


class LinkInOutputError(ExistingOutputError):
    """A symbolic link inside an output sits where a run would write: diffprep never writes through one."""


class LockedError(DiffprepError):
    """Another run holds the output's lock."""


class DatasetValidationError(DiffprepError):
    """Validation found a problem with a finished dataset."""


class RejectError(Exception):
    """One sample cannot be used. The pipeline records it and goes on.

    ``reason`` is a short stable code (counted in the audit), ``detail`` the
    human explanation, ``phase`` where it happened (read, decode, encode).
    """

    def __init__(self, reason: str, detail: str = "", phase: str = "decode") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.phase = phase
