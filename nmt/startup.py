"""What every command does before its work: one process of several (`--distributed`), the
compilation cache in the workdir, and quiet logs."""

from __future__ import annotations

import os

import jax
from absl import flags, logging

from nmt import console


def define_distributed_flags() -> None:
  """--distributed and its settings, shared by train.py and decode.py."""
  flags.DEFINE_bool('distributed', False, 'Run as one of several processes (hosts): calls '
                    'jax.distributed.initialize(), which finds the coordinator, process count '
                    'and index itself under SLURM, Open MPI, Kubernetes and on Cloud TPU; '
                    'elsewhere set JAX_COORDINATOR_ADDRESS, --num_processes and --process_id.')
  flags.DEFINE_integer('num_processes', None, 'With --distributed: how many processes the job '
                       'has (default: from the cluster environment).', lower_bound=1)
  flags.DEFINE_integer('process_id', None, "With --distributed: this process's index, 0 on "
                       'the coordinator (default: from the cluster environment).', lower_bound=0)
  flags.DEFINE_integer('heartbeat_timeout_seconds', 100, 'With --distributed: a process that '
                       'has sent no heartbeat for this long counts as dead, and the others stop '
                       'with an error.', lower_bound=1)


def initialize_distributed_from_flags() -> None:
  """jax.distributed.initialize() if --distributed was given (before any other JAX call)."""
  settings = flags.FLAGS
  if settings.distributed:
    try:
      jax.distributed.initialize(num_processes=settings.num_processes,
                                 process_id=settings.process_id,
                                 heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds)
    except (ValueError, TypeError) as error:  # Settings missing or inconsistent.
      raise SystemExit(
          f'error: --distributed: {error} Without a cluster launcher JAX detects (SLURM, Open '
          'MPI, Kubernetes, Cloud TPU), set JAX_COORDINATOR_ADDRESS (host:port of process 0), '
          '--num_processes and --process_id (0 to num_processes - 1) on every process '
          '(docs/clusters.md).') from None


def use_compilation_cache(workdir: str) -> None:
  """Keeps XLA's compiled programs in WORKDIR/compilation_cache: a resumed run, and every
  decode.py call after the first, load them instead of compiling again.

  A cache folder set before (JAX_COMPILATION_CACHE_DIR) is kept.
  """
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update('jax_compilation_cache_dir', os.path.join(workdir, 'compilation_cache'))


def start(workdir: str) -> None:
  """Quiet library logs, `jax.distributed.initialize()` with --distributed, the workdir's
  compilation cache; processes other than 0 log warnings only (one host speaks for the run)."""
  console.quiet_libraries()
  initialize_distributed_from_flags()
  use_compilation_cache(workdir)
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)
