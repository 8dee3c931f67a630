"""The embedded Prefect server's fixed cost, phase by phase (``benchmarks/cli.py --phases``).

Each figure is timed inside a fresh process (so imports are cold as in a
command), rounds interleaved, best of the rounds printed with the slowest:

- ``import prefect`` (what the client imports) and the server's modules;
- in an empty ``PREFECT_HOME``: the database created and migrated to head,
  the block types registered on it, again on a registered database, the
  migrations run again at head (the no-op every later start pays);
- the template (``flows/prefect_home.py``) built, once per Prefect version,
  and copied into a fresh home;
- the embedded server of a terminal run (``start_detached_server``) from its
  start to ``/health`` in a fresh home without the template, a fresh home with
  it, and a used home; a trivial ``@flow`` run on it; its stop.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROUNDS = 2

DATABASE = r"""
import asyncio, json, sys, time
from pathlib import Path
t = time.perf_counter()
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration
r = {"import the server's database modules": time.perf_counter() - t}
async def main():
    db = provide_database_interface()
    t = time.perf_counter(); await db.create_db(); r["create + migrate an empty database"] = time.perf_counter() - t
    for key in ("register block types (empty)", "register block types (registered)"):
        t = time.perf_counter()
        async with await db.session() as session:
            await run_block_auto_registration(session=session)
        r[key] = time.perf_counter() - t
    t = time.perf_counter(); await db.create_db(); r["migrations at head (every start)"] = time.perf_counter() - t
asyncio.run(main())
from diffprep.flows import prefect_home as h
t = time.perf_counter(); head = h.head_revision(); r["head revision"] = time.perf_counter() - t
t = time.perf_counter(); h.build_template(Path(sys.argv[1]) / "template.db")
r["template built (once per Prefect version)"] = time.perf_counter() - t
t = time.perf_counter(); h.seed_from(Path(sys.argv[1]) / "template.db", Path(sys.argv[1]) / "seeded.db", head)
r["template copied"] = time.perf_counter() - t
print("PHASES " + json.dumps(r))
"""

SERVER = r"""
import json, time
t = time.perf_counter()
import prefect
r = {"import prefect": time.perf_counter() - t}
from diffprep.flows.embedded_server import start_detached_server
t = time.perf_counter(); server = start_detached_server(); r["server start to /health"] = time.perf_counter() - t
@prefect.flow
def trivial():
    return 1
t = time.perf_counter(); trivial(); r["trivial flow run"] = time.perf_counter() - t
t = time.perf_counter(); server.stop(); r["server stop"] = time.perf_counter() - t
print("PHASES " + json.dumps(r))
"""


def _child(code: str, env: dict[str, str], *args: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("PHASES "):
            return json.loads(line[len("PHASES "):])
    raise RuntimeError(f"phase child exited with {done.returncode}:\n{done.stderr[-3000:]}")


def report(env: dict[str, str], scratch: Path) -> dict[str, dict[str, float]]:
    """Print (and return) the best and slowest seconds of every phase."""
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(ROUNDS):
        base = scratch / f"phases-{r}"
        homes = {"database": base / "db", "fresh home, unseeded": base / "unseeded",
                 "fresh home, seeded": base / "seeded"}
        for home in homes.values():
            home.mkdir(parents=True)
        cases = [("database", DATABASE, homes["database"], {}),
                 ("fresh home, unseeded", SERVER, homes["fresh home, unseeded"], {"DIFFPREP_PREFECT_TEMPLATE": "0"}),
                 ("fresh home, seeded", SERVER, homes["fresh home, seeded"], {}),
                 ("used home", SERVER, homes["fresh home, seeded"], {})]
        if r % 2:  # the other order, the used home still after the seeded one it reuses
            cases = [cases[2], cases[3], cases[1], cases[0]]
        for case, code, home, extra in cases:
            figures = _child(code, env | {"PREFECT_HOME": str(home)} | extra, str(home))
            for phase, seconds in figures.items():
                runs.setdefault(case, {}).setdefault(phase, []).append(seconds)
    print("  embedded Prefect server, fixed cost by phase (best / slowest of "
          f"{ROUNDS} fresh processes each):")
    for case, phases in runs.items():
        print(f"    {case}:")
        for phase, seconds in phases.items():
            print(f"      {phase:<45} {min(seconds):6.2f} s / {max(seconds):6.2f} s")
    return runs
