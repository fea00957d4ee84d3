"""glibc malloc settings that keep XLA:CPU's per-step buffers mapped (Linux, CPU backend only).

XLA:CPU allocates the temporary buffer of each compiled program call with malloc and frees it
when the call ends; glibc serves blocks that large with a fresh `mmap` and returns them with
`munmap`, so every training step faults its temporary memory back in. One malloc arena, no
mmap-served blocks, no trimming and transparent huge pages keep that memory mapped between steps
(BENCHMARKS.md, "Training step"). The cost: the process keeps its peak heap.

glibc reads these settings (`GLIBC_TUNABLES`) only when a process starts, so train.py and the
training benchmark call `reexec_with_malloc_settings()` first, which restarts the interpreter
once with them added. GPU and TPU runs never restart: their step buffers live on the device.
TRANSFORMER_KEEP_MALLOC=1 keeps the environment's own settings on CPU too.
"""

from __future__ import annotations

import importlib.util
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
# Packages whose presence makes JAX pick an accelerator when JAX_PLATFORMS is unset.
ACCELERATOR_PACKAGES = ('libtpu', 'jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin',
                        'jax_rocm7_plugin')


def cpu_backend_expected(environ: dict[str, str]) -> bool:
  """Whether JAX will run on the CPU, judged before importing it (JAX_PLATFORMS, plugins)."""
  platforms = environ.get('JAX_PLATFORMS', '').strip()
  if platforms:
    return platforms.split(',')[0].strip().lower() == 'cpu'
  for name in ACCELERATOR_PACKAGES:
    try:
      if importlib.util.find_spec(name) is not None:
        return False
    except (ImportError, ValueError):
      continue
  return True


def missing_tunables(environ: dict[str, str]) -> list[str]:
  """The TUNABLES whose names `environ['GLIBC_TUNABLES']` does not set (a user's value wins)."""
  current = {item.split('=', 1)[0] for item in environ.get('GLIBC_TUNABLES', '').split(':')}
  return [t for t in TUNABLES if t.split('=', 1)[0] not in current]


def reexec_with_malloc_settings() -> None:
  """Restarts this Python process with TUNABLES added to GLIBC_TUNABLES, unless not needed.

  Does nothing off Linux/glibc, off the CPU backend, when TRANSFORMER_KEEP_MALLOC is set, or
  when every tunable is already set. Call it before anything else in a program's `__main__`:
  what ran before is run again after the restart.
  """
  if not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
    return
  if os.environ.get(OPT_OUT) or not cpu_backend_expected(os.environ):
    return
  missing = missing_tunables(os.environ)
  if not missing:
    return
  env = dict(os.environ)
  env['GLIBC_TUNABLES'] = ':'.join(filter(None, [env.get('GLIBC_TUNABLES', ''), *missing]))
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
