"""One rank of small runs through diffprep.run.launch's steps, for tests/test_ranks.py: no model, no Prefect.

``python tests/rank_scenarios.py PORT,PORT,...`` with ``RANK``, ``WORLD_SIZE=2``
and ``MASTER_ADDR`` set. The process runs the scenarios below one after the
other (torch imported once), the ranks meeting on the next port each time. In
each, a rank goes through the steps a diffprep rank takes (join, decide,
encode its units, the outcome, leave) with units that sleep instead of
encoding, and a failure where the scenario puts one:

- ``raise``: rank 1 raises in its first unit; rank 0's units take 2 s each.
- ``after``: every unit succeeds, then rank 0 fails the way an audit would.
- ``stop``: rank 0 fails before it decides (the way a sanity check would).
- ``kill``: rank 1 SIGKILLs itself in its first unit (the last of rank 1's scenarios).
- ``alone``: rank 0 starts and no other rank joins (join timeout 3 s).

Prints every line as ``[scenario] ...``: ``unit N`` per unit this rank
encoded, ``seen U by W in S s`` per unit rank 0's progress got, ``error: ...``
on a failure, and ``status N`` (0, or 2 after an error).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from diffprep.run import launch
from diffprep.errors import DiffprepError

SCENARIOS = ("raise", "after", "stop", "kill", "alone")
UNITS = list(range(6))


def run(scenario: str, ranks: launch.Ranks) -> int:
    def say(text: str) -> None:
        print(f"[{scenario}] {text}", flush=True)

    try:
        group = launch.Group(ranks, timeout_s=60, join_s=3 if scenario == "alone" else 60)
    except DiffprepError as error:
        say(f"error: {error}")
        return 2
    launch._GROUP = group  # as launch.join does

    def encode(unit: int) -> dict:
        if ranks.rank == 1 and scenario == "raise":
            raise ValueError(f"unit {unit} is bad on purpose")
        if ranks.rank == 1 and scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.perf_counter()
        if scenario == "raise":  # rank 0's unit lasts until rank 1's failure is posted (at most 60 s)
            while not group._stop_posted() and time.perf_counter() - started < 60:
                time.sleep(0.05)
        time.sleep(0.3)
        say(f"unit {unit}")
        return {"unit": unit, "count": 4, "rejected": 0, "seconds": round(time.perf_counter() - started, 3)}

    def seen(result: dict) -> None:
        if ranks.rank == 0:
            say(f"seen {result['unit']} by {result['worker']} in {result['seconds']} s")

    try:
        if ranks.rank == 0:
            if scenario == "stop":
                raise DiffprepError("sanity check failed: on purpose")
            group.decide({"units": UNITS})
            group.encode(launch.my_units(UNITS, ranks), encode, seen)
            if scenario == "after":
                raise DiffprepError("audit failed: on purpose")
        elif group.decide() is not None:
            group.encode(launch.my_units(UNITS, ranks), encode, seen)
            group.outcome()
    except BaseException as error:
        launch.leave(error)
        say(f"error: {error}")
        return 2
    launch.leave()
    return 0


def main(ports: str) -> int:
    ranks = launch.detect_ranks()
    for scenario, port in zip(SCENARIOS, ports.split(",")):
        if scenario == "alone" and ranks.rank != 0:
            break
        os.environ["MASTER_PORT"] = port
        print(f"[{scenario}] status {run(scenario, ranks)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
