"""A fresh ``PREFECT_HOME``'s database, seeded from an already-migrated template.

The embedded server's first start in an empty ``PREFECT_HOME`` (every CI job,
container and first-time user) creates its SQLite database and runs Prefect's
whole alembic history on it, then registers every block type: seconds of a
2-core machine, each fresh home (``benchmarks/cli.py``, side ``embedded-fresh``).
The schema is the same every time for one installed Prefect, so it is built
once, as a template in the user's cache folder (``prefect-<version>.db``:
migrated by Prefect's own ``create_db`` and block registration on a database
of its own), and a fresh home gets a copy of it.

``seed_database`` runs in the embedded server's own process, before uvicorn
(``embedded_server.py``): that process imports Prefect's server modules anyway.
It copies only when the run's database is a SQLite file that does not exist
yet, and only when the template's alembic revision is this Prefect's head for
SQLite; otherwise it leaves Prefect's own path (create and migrate) alone. A
stale or missing template is built again first. The copy is SQLite's backup of
the template into a temporary file beside the target, linked into place only
if the target still does not exist; the server then migrates (a no-op at head)
and registers the block types as it always does. Any failure is logged and
falls back to Prefect's own path. ``DIFFPREP_PREFECT_TEMPLATE=0`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import tempfile
from pathlib import Path

import prefect
from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

log = logging.getLogger("diffprep.prefect_home")
SWITCH = "DIFFPREP_PREFECT_TEMPLATE"


def template_path() -> Path:
    """Where this Prefect's template lives: ``$XDG_CACHE_HOME/diffprep`` (default ``~/.cache/diffprep``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "diffprep" / f"prefect-{prefect.__version__}.db"


def head_revision() -> str:
    """The alembic head of this Prefect's SQLite migrations (its own script folder, as its ``env.py`` sets it)."""
    from alembic.script import ScriptDirectory
    from prefect.server.database.alembic_commands import alembic_config
    from prefect.server.database.orm_models import AioSqliteORMConfiguration

    script = ScriptDirectory.from_config(alembic_config())
    versions = ScriptDirectory(script.dir, version_locations=[str(AioSqliteORMConfiguration().versions_dir)])
    heads = versions.get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"Prefect's SQLite migrations have {len(heads)} heads: {heads}")
    return heads[0]


def revision_of(database: Path) -> str | None:
    """The alembic revision recorded in ``database`` (None: no such file, or no ``alembic_version`` table)."""
    if not database.is_file():
        return None
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
            rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.Error:
        return None
    return rows[0][0] if len(rows) == 1 else None


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite connection URL; None for another dialect or an in-memory database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).expanduser()


def build_template(template: Path) -> None:
    """Migrate an empty database to head and register the block types (Prefect's own calls), into ``template``."""
    template.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=template.name + ".", suffix=".building", dir=template.parent)
    os.close(fd)
    os.unlink(name)  # Prefect creates it; an existing empty file is a database of no tables
    building = Path(name)
    url = f"sqlite+aiosqlite:///{building}"
    from prefect.server.database.configurations import AioSqliteConfiguration
    from prefect.server.database.dependencies import temporary_database_interface

    try:
        # Prefect's database interface is pinned per process by its first use: this one is for the build only.
        with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: url}), \
                temporary_database_interface(AioSqliteConfiguration(connection_url=url)):
            asyncio.run(_migrate_and_register())
        _backup(building, template.with_suffix(".copy"))  # one file, its WAL folded in
        os.replace(template.with_suffix(".copy"), template)  # atomic: a concurrent builder's copy is as good
    finally:
        for leftover in (building, Path(f"{building}-wal"), Path(f"{building}-shm"), template.with_suffix(".copy")):
            leftover.unlink(missing_ok=True)


async def _migrate_and_register() -> None:
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration

    db = provide_database_interface()
    await db.create_db()
    async with await db.session() as session:
        await run_block_auto_registration(session=session)


def _backup(source: Path, target: Path) -> None:
    with sqlite3.connect(f"file:{source}?mode=ro", uri=True) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode = DELETE")  # a plain file at rest; Prefect's connections set WAL again
    dst.close()
    src.close()


def seed_from(template: Path, target: Path, head: str) -> str:
    """Copy ``template`` to ``target`` when ``target`` does not exist and the template is at ``head``; the outcome."""
    if target.exists():
        return "present"
    revision = revision_of(template)
    if revision != head:
        return f"refused: template at revision {revision}, this Prefect's head is {head}"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=target.name + ".", suffix=".seeding", dir=target.parent)
    os.close(fd)
    seeding = Path(name)
    try:
        _backup(template, seeding)
        try:
            os.link(seeding, target)  # never over a database that appeared meanwhile
        except FileExistsError:
            return "present"
    finally:
        seeding.unlink(missing_ok=True)
    return "seeded"


def seed_database() -> str:
    """Seed this process's Prefect database from the template when it is a SQLite file not yet there; the outcome
    (``seeded``, ``present``, ``off``, ``not sqlite``, ``refused: ...``, ``failed: ...``)."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return "off"
    try:
        target = sqlite_file(PREFECT_API_DATABASE_CONNECTION_URL.value())
        if target is None:
            return "not sqlite"
        if target.exists():
            return "present"
        template, head = template_path(), head_revision()
        if revision_of(template) != head:
            build_template(template)
        outcome = seed_from(template, target, head)
    except Exception as error:  # noqa: BLE001 - Prefect's own path (create and migrate) is always there
        outcome = f"failed: {type(error).__name__}: {error}"
    if outcome.startswith(("refused", "failed")):
        log.warning("Prefect's database not seeded from the template (%s); Prefect creates it", outcome)
    return outcome


__all__ = ["build_template", "head_revision", "revision_of", "seed_database", "seed_from", "sqlite_file",
           "template_path"]
