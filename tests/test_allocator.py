"""diffprep.run.allocator: glibc's thresholds set in a fresh process, or left alone as documented.

Each case runs in a subprocess (malloc settings are per process) and observes
what the setting is for: a 64 MiB block, which glibc's defaults always
``mmap`` (its dynamic threshold stops at 32 MiB), comes from the heap once
tuned, and the heap keeps it after ``free`` instead of trimming it.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from diffprep.run import allocator

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="needs glibc >= 2.33 (mallopt, mallinfo2)",
)

PROBE = r"""
import ctypes, json
from diffprep.run.allocator import tune_malloc

result = tune_malloc()
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
before = libc.mallinfo2()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({"applied": result.applied, "reason": result.reason,
                  "mmapped": during.hblks - before.hblks,
                  # The heap grew by the block (less what was free in it already) and was not trimmed back.
                  "heap_kept_after_free": during.arena - before.arena >= size - before.fordblks
                                          and after.arena >= during.arena}))
"""


def probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in (*allocator.USER_VARIABLES, allocator.SWITCH, "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", PROBE], env=base | {"PYTHONPATH": str(REPO)} | env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_defaults_untuned_mmap_a_large_block():
    # The reference point: what every other case is told apart from.
    out = probe(DIFFPREP_MALLOC_TUNING="0")
    assert not out["applied"] and "DIFFPREP_MALLOC_TUNING=0" in out["reason"]
    assert out["mmapped"] == 1


def test_applied_by_default_large_blocks_come_from_the_heap_and_stay():
    out = probe()
    assert out["applied"], out["reason"]
    assert out["mmapped"] == 0
    assert out["heap_kept_after_free"]


@pytest.mark.parametrize("value", ["off", "false", "no"])
def test_switch_turns_it_off(value):
    out = probe(DIFFPREP_MALLOC_TUNING=value)
    assert not out["applied"]
    assert out["mmapped"] == 1


def test_switch_on_values_keep_it():
    assert probe(DIFFPREP_MALLOC_TUNING="1")["applied"]


def test_user_environment_wins():
    # A user threshold of 64 KiB: their setting must still be the one in force afterwards.
    out = probe(MALLOC_MMAP_THRESHOLD_="65536")
    assert not out["applied"] and "MALLOC_MMAP_THRESHOLD_" in out["reason"]
    assert out["mmapped"] == 1


def test_user_trim_threshold_alone_also_wins():
    out = probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert not out["applied"] and "MALLOC_TRIM_THRESHOLD_" in out["reason"]
    assert not out["heap_kept_after_free"]


def test_user_glibc_tunables_win():
    out = probe(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert not out["applied"] and "glibc.malloc.mmap_threshold" in out["reason"]
    assert out["mmapped"] == 1


def test_not_glibc_is_skipped(monkeypatch):
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.delenv(allocator.SWITCH, raising=False)
    for name in (*allocator.USER_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    result = allocator.tune_malloc()
    assert not result.applied and "not glibc" in result.reason
    assert allocator.tune_malloc() is result  # once per process
