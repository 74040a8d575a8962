"""The tracediff program's own process settings (tracediff.runtime)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _peak_after_churn(setting: bool) -> tuple[bool, int, int]:
    """In a fresh interpreter: allocate and free a 24 MiB block (glibc then raises its mmap threshold to 24 MiB),
    then allocate and free many 8 MiB blocks; the RSS left held after the frees, in MiB."""
    code = textwrap.dedent(f"""
        import ctypes, sys
        from tracediff.runtime import return_freed_memory
        made = return_freed_memory() if {setting} else False
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) // 1024
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        def touch(p, n):
            ctypes.memset(p, 1, n)
        big = libc.malloc(24 << 20); touch(big, 24 << 20); libc.free(big)
        base = rss()
        blocks = [libc.malloc(8 << 20) for _ in range(24)]
        for b in blocks:
            touch(b, 8 << 20)
        for b in blocks[:-1]:  # the last one pins the heap's top: freed heap below it stays resident
            libc.free(b)
        print(made, base, rss())
    """)
    # glibc's own defaults: no MALLOC_* / GLIBC_TUNABLES from this process (dask's nannies put
    # MALLOC_TRIM_THRESHOLD_ into os.environ of the process that starts a LocalCluster).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


def test_freed_blocks_go_back_to_the_system():
    if not sys.platform.startswith("linux"):
        return
    made, base, after = _peak_after_churn(True)
    assert made
    # 23 of 24 blocks freed: with every 1 MiB+ block its own mapping, one block (8 MiB) stays held.
    assert after - base < 40, (base, after)
    default_made, default_base, default_after = _peak_after_churn(False)
    assert not default_made
    # Without the setting, glibc's raised threshold keeps the freed blocks in its heap.
    assert default_after - default_base > 150, (default_base, default_after)


def _second_round_faults(setting: bool) -> tuple[bool, int, int]:
    """In a fresh interpreter, on a thread (its own malloc arena, as a streaming thread): allocate,
    touch and free 24 blocks of 256 KiB twice; the page faults of the second round, and its pages."""
    code = textwrap.dedent(f"""
        import ctypes, resource, threading
        from tracediff.runtime import return_freed_memory
        made = return_freed_memory() if {setting} else False
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        size, count, out = 256 << 10, 24, []
        def rounds():
            for r in range(2):
                before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                blocks = [libc.malloc(size) for _ in range(count)]
                for b in blocks:
                    ctypes.memset(b, 1, size)
                for b in reversed(blocks):
                    libc.free(b)
                out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        t = threading.Thread(target=rounds)
        t.start(); t.join()
        print(made, out[1], size * count // 4096)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


def test_a_threads_freed_blocks_below_the_threshold_are_reused_without_page_faults():
    """Blocks under 1 MiB stay in the thread's arena: freeing them and allocating again (a streaming
    thread block after block) must not hand the pages back and fault them in again."""
    if not sys.platform.startswith("linux"):
        return
    made, faults, pages = _second_round_faults(True)
    assert made
    assert faults < pages // 4, (faults, pages)
