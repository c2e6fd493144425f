"""Handing freed heap memory back to the operating system.

glibc's ``malloc`` keeps the pages of freed small and medium blocks in its arenas for reuse, so a
process that trains a model in place goes on holding gigabytes it no longer uses. Measured on
SmolLM2-135M: the routing study's driver held 3.8 GB after a short SFT run returned, 0.7 GB after
``malloc_trim(0)``; a learner grew from 2.6 GB to 9.7 GB over two updates of 16 x 500 tokens, and
stays at 2.6 GB when it releases after each update. On a 24 GB machine that difference decides whether
the RL runtime started next (engine, learner, shards) fits beside the driver. ``malloc_trim``
returns every whole free page of every arena (glibc >= 2.8 also releases pages inside the heap,
not only at its top). Other C libraries and platforms have no such call; there it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache  # find_library runs ldconfig in a subprocess: look libc up once, not per release
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # musl has no malloc_trim


def resident_bytes() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; 0 where it is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return 0


def release_freed_memory() -> bool:
    """Collect unreachable Python objects, then return glibc's free heap pages to the OS.

    Returns whether a trim ran (False off glibc). Call it after a large piece of work whose
    tensors are no longer referenced, not in a hot loop: a trim walks every arena."""
    gc.collect()
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
