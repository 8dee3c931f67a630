"""A fresh PREFECT_HOME's database seeded from the migrated template (``flows/prefect_home.py``).

A real template (Prefect's own migrations and block registration on a SQLite file), a real embedded server
started as a terminal run starts it, in a subprocess with a fresh home.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diffprep.flows import prefect_home

REPO = Path(__file__).resolve().parents[1]
MARK = "diffprep_test_template_mark"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "prefect.db"
    prefect_home.build_template(path)
    return path


def _tables(database: Path) -> set[str]:
    with sqlite3.connect(database) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_the_template_is_at_head_and_copied_only_into_a_missing_database(template, tmp_path):
    head = prefect_home.head_revision()
    assert prefect_home.revision_of(template) == head
    assert {"flow_run", "block_type", "alembic_version"} <= _tables(template)
    target = tmp_path / "home" / "prefect.db"
    assert prefect_home.seed_from(template, target, head) == "seeded"
    assert prefect_home.revision_of(target) == head and _tables(target) == _tables(template)
    assert sorted(p.name for p in target.parent.iterdir()) == ["prefect.db"]  # no temporary file left
    target.write_bytes(b"a database of its own")
    assert prefect_home.seed_from(template, target, head) == "present"
    assert target.read_bytes() == b"a database of its own"


def test_a_template_not_at_this_prefects_head_is_refused(template, tmp_path):
    stale = tmp_path / "stale.db"
    shutil.copy(template, stale)
    with sqlite3.connect(stale) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'aaaaaaaaaaaa'")
    target = tmp_path / "home" / "prefect.db"
    outcome = prefect_home.seed_from(stale, target, prefect_home.head_revision())
    assert outcome.startswith("refused: template at revision aaaaaaaaaaaa"), outcome
    assert not target.exists()
    assert prefect_home.seed_from(tmp_path / "missing.db", target, prefect_home.head_revision()).startswith("refused")
    assert prefect_home.sqlite_file("postgresql+asyncpg://u:p@db/prefect") is None
    assert prefect_home.sqlite_file("sqlite+aiosqlite:///:memory:") is None


RUN = textwrap.dedent("""
    import prefect
    from diffprep.flows.embedded_server import start_detached_server

    start_detached_server()

    @prefect.flow(name="seeded-home")
    def seeded_home():
        return 42

    assert seeded_home() == 42
""")


def test_a_fresh_home_runs_on_a_seeded_database_and_a_stale_template_is_rebuilt(template, tmp_path):
    cache = tmp_path / "cache"
    marked = prefect_home.template_path().relative_to(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"))
    (cache / marked).parent.mkdir(parents=True)
    shutil.copy(template, cache / marked)
    with sqlite3.connect(cache / marked) as conn:  # a mark only the template has: the run's database is its copy
        conn.execute(f"CREATE TABLE {MARK} (x INTEGER)")
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env |= {"PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache)}

    def run(home: Path) -> Path:
        env["PREFECT_HOME"] = str(home)
        done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "not seeded" not in done.stdout + done.stderr
        return home / "prefect.db"

    database = run(tmp_path / "home")
    assert MARK in _tables(database)
    with sqlite3.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'").fetchone() == (1,)
    with sqlite3.connect(cache / marked) as conn:  # a stale template: built again, then copied
        conn.execute("UPDATE alembic_version SET version_num = 'aaaaaaaaaaaa'")
    database = run(tmp_path / "home-2")
    assert MARK not in _tables(database) and prefect_home.revision_of(cache / marked) == prefect_home.head_revision()


def test_the_command_builds_the_template_only_when_it_is_not_at_head(template, tmp_path, monkeypatch, capsys):
    from diffprep.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = prefect_home.template_path()
    built.parent.mkdir(parents=True)
    shutil.copy(template, built)
    with sqlite3.connect(built) as conn:  # a mark of this copy: a rebuild would not have it
        conn.execute(f"CREATE TABLE {MARK} (x INTEGER)")
    assert main(["prefect-template"]) == 0
    assert "already migrated" in capsys.readouterr().out and MARK in _tables(built)
