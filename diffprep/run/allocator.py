"""glibc malloc settings for processes that run encoders on a CPU, applied at run time.

With glibc's defaults, every large tensor torch allocates on the CPU (a VAE
activation is tens of MiB) is a fresh ``mmap``, and freeing it gives the pages
back to the kernel, so the next batch page-faults them in again: CPU VAE
encoding spent about half its time in page faults (benchmarks/README.md: a
whole ``diffprep encode`` at about 12 samples/s with the defaults, 24.5 with
the environment variables ``MALLOC_MMAP_THRESHOLD_=MALLOC_TRIM_THRESHOLD_=4000000000``).

Those variables are read once, when the process starts, so a program cannot
set them for itself. :func:`tune_malloc` sets the same two thresholds with
``mallopt`` instead, for the rest of the process's life:

- ``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD`: allocations up to 2 GiB come
  from the heap, where freed memory is reused. Setting it also turns off
  glibc's dynamic threshold, which would otherwise never go above 32 MiB
  (HEAP_MAX/2 on 64-bit), below the size of the tensors that matter.
- ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD`: the top of the heap is not
  handed back to the kernel after each batch.

``mallopt`` takes a C ``int``, so 2**31 - 1 is the largest value it accepts
(the environment form took 4e9; no allocation of an encode process comes near
either). The cost is memory that stays in the process once a batch has used
it: peak RSS is measured with and without in benchmarks/memory.py.

Nothing is changed when:

- ``DIFFPREP_MALLOC_TUNING=0`` (or ``false``/``no``/``off``): the documented switch;
- the user set ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or either
  as a ``GLIBC_TUNABLES`` entry: glibc already applied theirs at start-up;
- the C library is not glibc (musl, macOS): ``mallopt`` is glibc's.

GPU runs allocate little on the host; the setting is harmless there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from dataclasses import dataclass

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "SWITCH", "MallocTuning", "tune_malloc"]

log = logging.getLogger("diffprep.allocator")

# mallopt parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 2**31 - 1
TRIM_THRESHOLD = 2**31 - 1

SWITCH = "DIFFPREP_MALLOC_TUNING"
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
_OFF = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class MallocTuning:
    """What :func:`tune_malloc` did in this process: ``applied``, or why not (``reason``)."""

    applied: bool
    reason: str


_done: MallocTuning | None = None


def _skip_reason() -> str | None:
    if os.environ.get(SWITCH, "").strip().lower() in _OFF:
        return f"turned off by {SWITCH}={os.environ[SWITCH]}"
    user = [name for name in USER_VARIABLES if name in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    user += [name for name in USER_TUNABLES if name in tunables]
    if user:
        return f"the environment already sets {', '.join(user)}: glibc applied it at start-up"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"the C library is {libc_name or 'not glibc'}; mallopt is glibc's"
    return None


def tune_malloc() -> MallocTuning:
    """Set glibc's mmap and trim thresholds for this process, once; see the module docstring.

    Call it before the encoders are loaded: memory already allocated keeps
    its place. Safe to call again (later calls return the first result) and
    from any process; it never raises.
    """
    global _done
    if _done is not None:
        return _done
    reason = _skip_reason()
    if reason is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.mallopt.restype = ctypes.c_int
            # mallopt returns 1 on success, 0 when it refuses the value.
            ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
            reason = "" if ok else "glibc's mallopt refused the values"
        except (OSError, AttributeError) as exc:
            reason = f"mallopt is not available: {exc}"
    _done = MallocTuning(applied=not reason, reason=reason or
                         f"M_MMAP_THRESHOLD={MMAP_THRESHOLD} M_TRIM_THRESHOLD={TRIM_THRESHOLD}")
    log.debug("malloc tuning: %s", _done)
    return _done
