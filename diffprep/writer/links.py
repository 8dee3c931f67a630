"""Nothing is written, renamed or removed through a symbolic link inside an output.

A link in an output points at files that are not the output's (another dataset's empty encodings, a shared
folder): writing there would change them. Every writer of an output checks its path here (``no_link_below``)
and refuses with ``LinkInOutputError``; ``diffprep.validation.ownership`` refuses a run before its first write
where a link sits in its way. The output folder itself may be a link: only what is below it is checked.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffprep.errors import LinkInOutputError


def no_link_below(root: Path, path: Path) -> Path:
    """``path`` when no folder or file from ``root`` (excluded) down to it is a symbolic link; else
    ``LinkInOutputError`` naming the link. Nothing is written, renamed or removed through a link inside an output:
    it points at files that are not the output's (another dataset's, a shared folder)."""
    root, path = Path(root), Path(path)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise LinkInOutputError(link_message(root, current.relative_to(root).as_posix()))
    return path


def link_message(root: Path | str, relative: str | list[str]) -> str:
    """What a user reads about links inside an output where a run would write."""
    links = [relative] if isinstance(relative, str) else relative
    named = ", ".join(f"`{name}` -> {link_target(Path(root) / name)}" for name in links[:10])
    more = f" and {len(links) - 10} more" if len(links) > 10 else ""
    return (f"{root}: {named}{more} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'} where this "
            "run writes; diffprep never writes, renames or removes through a link inside an output (it would change "
            "files outside it). Nothing was written: move the link out of the output (or replace it with a folder "
            "of its own), or write to another output (--on-existing new-dir, or another --output-dir).")


def link_target(path: Path) -> str:
    """Where the link ``path`` points, as it is written."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


__all__ = ["link_message", "link_target", "no_link_below"]
