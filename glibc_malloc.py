"""glibc malloc settings that keep XLA:CPU's per-step buffers mapped (Linux only).

XLA:CPU allocates the temporary buffer of each compiled program call with malloc and frees it
when the call ends (555 MB for the training step of the benchmark shape). glibc serves blocks
that large with a fresh `mmap` and returns them with `munmap`, so every step faults half a
gigabyte of zeroed pages back in: 200 ms of kernel time in a 740 ms step, measured with
`perf stat` and `strace` (BENCHMARKS.md). With one malloc arena, no mmap-served blocks, no
trimming and transparent huge pages on the heap, the memory stays mapped between steps and the
kernel time falls to about 1 ms.

glibc reads these settings (`GLIBC_TUNABLES`) only when a process starts, so train.py and the
training benchmark call `reexec_with_malloc_settings()` first, which restarts the interpreter
once with them added. The cost: the process keeps its peak heap instead of returning it to the
system. Set TRANSFORMER_KEEP_MALLOC=1 to run with the environment's own malloc settings.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = (
    'glibc.malloc.arena_max=1',  # Every thread allocates from the main (brk) heap...
    'glibc.malloc.mmap_max=0',  # ...which then serves large blocks too...
    'glibc.malloc.trim_threshold=4294967295',  # ...and keeps them after free.
    'glibc.malloc.hugetlb=1',  # 2 MB pages where the kernel allows them (THP "madvise").
)
OPT_OUT = 'TRANSFORMER_KEEP_MALLOC'


def missing_tunables(environ: dict[str, str]) -> list[str]:
  """The TUNABLES whose names `environ['GLIBC_TUNABLES']` does not set (a user's value wins)."""
  current = {item.split('=', 1)[0] for item in environ.get('GLIBC_TUNABLES', '').split(':')}
  return [t for t in TUNABLES if t.split('=', 1)[0] not in current]


def reexec_with_malloc_settings() -> None:
  """Restarts this Python process with TUNABLES added to GLIBC_TUNABLES, unless not needed.

  Does nothing off Linux/glibc, when TRANSFORMER_KEEP_MALLOC is set, or when every tunable is
  already set. Call it before anything else in a program's `__main__`: what ran before is run
  again after the restart.
  """
  if not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
    return
  if os.environ.get(OPT_OUT):
    return
  missing = missing_tunables(os.environ)
  if not missing:
    return
  env = dict(os.environ)
  env['GLIBC_TUNABLES'] = ':'.join(filter(None, [env.get('GLIBC_TUNABLES', ''), *missing]))
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
