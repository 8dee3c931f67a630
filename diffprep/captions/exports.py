"""A written caption set in the forms other tools read, each only on request and never over files without an answer:

- the LTX trainer's metadata file (``--ltx-metadata FILE``: ``.json`` a list, ``.jsonl`` a row per line, ``.csv``),
  rows ``{"caption", "media_path"}`` with the path relative to the file's folder, as ``process_dataset.py``
  resolves it (an absolute path would mirror the whole path under ``.precomputed/``); a sample's first caption;
- the directory source's caption files (``--write-caption-files``): ``captions/<stem>.txt`` beside ``images/``
  and ``videos/``, as ``diffprep.sources.directory`` reads them.

Rejected samples are in neither (the audit names them).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Iterator

from diffprep.captions.sets import CAPTIONS_JSONL, CaptionSet
from diffprep.errors import ConfigError, DiffprepError
from diffprep.run.approvals import ABORT, Question
from diffprep.writer.shards import atomic_write_bytes

Ask = Callable[[Question, str | None], str]
LTX_FORMATS = (".json", ".jsonl", ".csv")


def _rows(cset: CaptionSet) -> Iterator[dict]:
    with open(cset.file(CAPTIONS_JSONL), encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _data_root(cset: CaptionSet) -> str:
    return os.path.dirname(os.path.dirname(cset.path))  # <root>/.captions/<NAME>


def replace_question(key: str, what: str, files: list[str], count: int) -> Question:
    shown = "\n".join(f"- `{f}`" for f in files[:10]) + (f"\n- ... ({count} in all)" if count > 10 else "")
    return Question(key=key, title=f"{what}: {count} file(s) exist", description=(
        f"Writing the caption set's {what} would replace these existing files:\n\n{shown}\n\n"
        "- **replace**: write them with the set's captions\n- **abort**: change nothing (the set itself is written)"),
        choices=("replace", ABORT), preset_hint="--on-replace-files replace")


def write_ltx_metadata(cset: CaptionSet, path: str, ask: Ask, preset: str | None = None) -> str:
    """The LTX trainer's metadata file at ``path``; an existing file is replaced only after ``ask``."""
    path = os.path.abspath(os.path.expanduser(path))
    extension = os.path.splitext(path)[1].lower()
    if extension not in LTX_FORMATS:
        raise ConfigError(f"--ltx-metadata {path}: the LTX trainer reads {', '.join(LTX_FORMATS)} files; end the "
                          "name with one of them")
    folder = os.path.dirname(path)
    root = _data_root(cset)
    rows = []
    for row in _rows(cset):
        if not row.get("media_path"):
            raise DiffprepError(f"caption set {cset.name}: the source gives no file path for {row['source_id']!r}, "
                                "so no LTX metadata file can name its media; caption a folder (--input-dir) or a "
                                "metadata file")
        rows.append({"caption": row["caption"],
                     "media_path": os.path.relpath(os.path.join(root, row["media_path"]), folder)})
    if extension == ".json":
        data = json.dumps(rows, ensure_ascii=False, indent=2) + "\n"
    elif extension == ".jsonl":
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    else:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["caption", "media_path"])
        writer.writeheader()
        writer.writerows(rows)
        data = buffer.getvalue()
    if os.path.exists(path) and _read(path) != data.encode("utf-8"):  # the same file again is no replacement
        ask(replace_question("ltx-metadata-exists", "LTX metadata file", [path], 1), preset)
    os.makedirs(folder, exist_ok=True)
    atomic_write_bytes(path, data.encode("utf-8"))
    return path


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_caption_files(cset: CaptionSet, ask: Ask, preset: str | None = None) -> int:
    """``captions/<stem>.txt`` for every captioned sample of a directory source (its first caption); existing
    caption files are replaced only after ``ask``. Returns how many were written."""
    root = _data_root(cset)
    planned: list[tuple[str, str]] = []
    for row in _rows(cset):
        media = row.get("media_path") or ""
        top, _, rel = media.partition("/")
        if top not in ("images", "videos") or not rel:
            raise DiffprepError(f"caption files are the directory source's (images/, videos/, captions/); "
                                f"{row['source_id']!r} is no file of such a folder")
        planned.append((os.path.join(root, "captions", os.path.splitext(rel)[0] + ".txt"), row["caption"]))
    # Files that already hold their caption are no replacement (the same command again asks nothing).
    existing = [p for p, caption in planned if os.path.exists(p) and _read(p) != caption.encode("utf-8")]
    if existing:
        ask(replace_question("caption-files-exist", "caption files", existing, len(existing)), preset)
    for path, caption in planned:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_bytes(path, caption.encode("utf-8"))
    return len(planned)


__all__ = ["LTX_FORMATS", "replace_question", "write_caption_files", "write_ltx_metadata"]
