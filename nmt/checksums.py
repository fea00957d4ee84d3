"""A checksum of every array of a tree, the same whatever its sharding over devices and hosts:
checkpoints record them at saving and check them at every restore (nmt/checkpoints.py)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

# Two independent 32-bit sums per array: a changed value goes unnoticed with odds 2^-64.
_CHECKSUM_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _mix(x: np.ndarray) -> np.ndarray:
  """A 32-bit integer hash (murmur3's finaliser), elementwise on uint32 (wrapping)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


def _shard_sums(data: np.ndarray, index: tuple, shape: tuple[int, ...]) -> np.ndarray:
  """[2] uint32: sums of hash(bits, global flat index) over one shard's elements.

  index: the shard's slices into the whole array of `shape`. Sums modulo 2^32 do not depend
  on the order of the additions, so shards add up to the whole array's sums.
  """
  if data.dtype == np.bool_:
    data = data.astype(np.uint8)
  bits = data.view(f'uint{data.dtype.itemsize * 8}').astype(np.uint32)
  flat_index = np.zeros(data.shape, np.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    start = index[axis].start or 0
    coordinate = (np.arange(start, start + data.shape[axis], dtype=np.uint64) * stride) % 2**32
    flat_index += coordinate.astype(np.uint32).reshape(
        [-1 if a == axis else 1 for a in range(len(shape))])
    stride = (stride * shape[axis]) % 2**32
  bits, flat_index = np.atleast_1d(bits), np.atleast_1d(flat_index)  # Arrays wrap silently.
  return np.array([np.sum(_mix(bits ^ _mix(flat_index + np.uint32(seed))), dtype=np.uint32)
                   for seed in _CHECKSUM_SEEDS], np.uint32)


def _local_sums(x: Any) -> tuple[np.ndarray, bool]:
  """[2] uint32: this process's share of an array's sums (each element counted by one
  process only: the shards with replica id 0), and whether other processes hold shares."""
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    total = np.zeros(2, np.uint32)
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        total += _shard_sums(np.asarray(shard.data), shard.index, x.shape)
    return total, not x.is_fully_addressable
  x = np.asarray(x)
  return _shard_sums(x, tuple(slice(0, n) for n in x.shape), x.shape), False


def path_name(path: tuple) -> str:
  """'a/b/0/count' for a tree path: the same for a saved tree (dicts and lists) and the
  live one (namedtuples), unlike jax.tree_util.keystr."""
  parts = []
  for key in path:
    for attribute in ('key', 'name', 'idx'):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


def checksums(tree: Any) -> dict[str, str]:
  """Each array's checksum as 16 hex digits, keyed by its path in the tree.

  Computed on the host from the shards this process holds (no compilation), then, for arrays
  spread over several processes, summed over processes: the same digits whatever the arrays'
  sharding and however many devices and hosts hold them. With several processes, every
  process calls it with the same tree.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  local = [_local_sums(leaf) for _, leaf in flat]
  sums = np.stack([s for s, _ in local]) if flat else np.zeros((0, 2), np.uint32)
  spread = np.array([is_global for _, is_global in local], bool)
  if jax.process_count() > 1 and spread.any():
    sums[spread] = np.sum(multihost_utils.process_allgather(sums[spread]), axis=0,
                          dtype=np.uint32)
  return {path_name(path): ''.join(f'{int(v):08x}' for v in value)
          for (path, _), value in zip(flat, sums)}
