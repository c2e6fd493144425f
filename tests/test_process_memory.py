"""``raggym.process_memory``: freed heap pages go back to the OS, which glibc alone does not do; and the
tests' own memory rule, the memory-heavy modules one at a time under xdist (``conftest.work_unit``)."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from conftest import MEMORY_HEAVY_MODULES, MEMORY_HEAVY_UNIT, REPO, work_unit
from raggym.process_memory import release_freed_memory, resident_bytes

on_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                              reason="malloc_trim is a glibc call")


def test_resident_bytes_sees_an_allocation_that_is_touched():
    before = resident_bytes()
    block = bytearray(64 * 2**20)  # zero-filled, so every page is touched
    assert resident_bytes() - before >= 60 * 2**20
    del block


@on_glibc
def test_freed_heap_pages_are_returned_only_after_the_release():
    # 3,000 blocks of 64 KiB (below glibc's 128 KiB mmap threshold, so they live in the heap),
    # every tenth kept: the kept ones pin the heap's top, so glibc's own trimming cannot give the
    # ~170 MiB of freed blocks back, and the process stays at its high-water mark...
    blocks = [bytearray(64 * 1024) for _ in range(3000)]
    kept = blocks[::10]
    del blocks
    held = resident_bytes()
    # ...until the release hands back every whole free page inside the heap
    assert release_freed_memory() is True
    released = held - resident_bytes()
    assert released >= 120 * 2**20, f"only {released / 2**20:.0f} MiB came back"
    assert all(len(b) == 64 * 1024 for b in kept)  # the live blocks are untouched


# ----------------------------------------------------------------------------- memory-heavy test modules

def test_memory_heavy_modules_share_one_unit_of_work_and_the_rest_keep_their_module():
    heavy_a, heavy_b = MEMORY_HEAVY_MODULES[:2]
    assert work_unit(f"{heavy_a}::test_x") == work_unit(f"{heavy_b}::test_y[vllm]") == MEMORY_HEAVY_UNIT
    assert work_unit("tests/test_atomic.py::test_x[a::b]") == "tests/test_atomic.py"


def test_every_memory_heavy_module_exists():
    # a renamed module would silently fall out of the group and run beside the others again
    missing = [m for m in MEMORY_HEAVY_MODULES if not (REPO / m).is_file()]
    assert not missing, missing
