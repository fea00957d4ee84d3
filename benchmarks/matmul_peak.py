"""The float32 matmul peak that the benchmarks divide out: one definition for all of them.

  python -m benchmarks.matmul_peak [--size 2048] [--repeats 10]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def matmul_peak_gflops(size: int = 2048, repeats: int = 10) -> float:
  """Best GFLOP/s of a jitted float32 size^3 matmul over `repeats` timed runs.

  The best run, not the median: the machine may be shared, and the peak is what it can do.
  """
  if size < 1 or repeats < 1:
    raise ValueError(f'size and repeats must be positive, got {size} and {repeats}.')
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, b))  # Compile and warm up.
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best / 1e9


def main(argv=None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--size', type=int, default=2048)
  parser.add_argument('--repeats', type=int, default=10)
  args = parser.parse_args(argv)
  peak = matmul_peak_gflops(args.size, args.repeats)
  print(f'matmul peak: {peak:.1f} GFLOP/s (float32 {args.size}^3, best of {args.repeats})')
  return peak


if __name__ == '__main__':
  main()
