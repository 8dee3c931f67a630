"""A named check and its findings: what validation, and each encoding's sample inspector, report.

A check never only logs: it ends as a ``Check`` (name, ok, detail), with the
first few findings named in the detail.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PROBLEMS_SHOWN = 10


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


class Findings:
    """Problems found by one check, turned into a single ``Check`` with the first few named."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def check(self, ok_detail: str) -> Check:
        if not self.items:
            return Check(self.name, True, ok_detail)
        shown = self.items[:MAX_PROBLEMS_SHOWN]
        more = len(self.items) - len(shown)
        detail = "\n".join(shown) + (f"\n… and {more} more" if more else "")
        return Check(self.name, False, detail)


def shape_str(shape: tuple[int, ...] | list[int | None]) -> str:
    return "x".join("*" if dim is None else str(dim) for dim in shape)


__all__ = ["Check", "Findings", "shape_str"]
