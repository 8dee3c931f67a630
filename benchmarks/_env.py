"""Process environment for the benchmarks, applied before torch or diffusers is imported.

glibc reads its ``MALLOC_*`` settings once, at start-up, so ``--malloc`` is
applied by re-executing the script with them set; both sides of every ratio
then run under the same settings. Import this module first.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
# FACTS.md: with these, CPU VAE encoding stops spending its time in page faults.
MALLOC_TUNED = "4000000000"
MALLOC_MODES = ("tuned", "default", "inherit")
MALLOC_HELP = (f"glibc malloc settings for the whole process, so for both sides of every ratio: tuned sets "
               f"{' and '.join(MALLOC_VARS)} to {MALLOC_TUNED}, default unsets them, inherit keeps the "
               "environment as it is (default: tuned)")


def malloc_mode(argv: list[str]) -> str:
    """The ``--malloc`` value in ``argv`` (default ``tuned``); argparse validates it again later."""
    for i, arg in enumerate(argv):
        if arg == "--malloc" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--malloc="):
            return arg.split("=", 1)[1]
    return "tuned"


def apply_malloc(mode: str | None = None) -> None:
    """Re-execute this script under the asked malloc settings unless they are already in effect."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return  # a spawned worker: it inherited its parent's environment, and its argv is not the script's
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is None or os.path.dirname(os.path.abspath(script)) != os.path.dirname(os.path.abspath(__file__)):
        return  # imported by something other than a benchmark script: leave that process alone
    mode = mode or malloc_mode(sys.argv[1:])
    if mode not in MALLOC_MODES or mode == "inherit":
        return  # an invalid value is refused by the script's argument parser
    want = dict.fromkeys(MALLOC_VARS, MALLOC_TUNED) if mode == "tuned" else {}
    have = {name: os.environ[name] for name in MALLOC_VARS if name in os.environ}
    if have == want:
        return
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS} | want
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def malloc_description() -> str:
    """The settings both sides of every ratio ran under: glibc malloc and the OpenMP wait policy."""
    values = [f"{name}={os.environ[name]}" for name in MALLOC_VARS if name in os.environ]
    malloc = " ".join(values) if values else "glibc malloc defaults (MALLOC_* unset)"
    return f"{malloc}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"


apply_malloc()
