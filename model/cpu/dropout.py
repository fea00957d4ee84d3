"""Dropout from a counter-based hash instead of threefry bits: cheaper masks on CPU.

Used when `TransformerConfig.cpu_tuned` is on; measured in BENCHMARKS.md, "Training step"
(dropout masks from a counter-based hash).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _mix32(h: Array) -> Array:
  """MurmurHash3's 32-bit finaliser: a bijection on uint32 with full avalanche."""
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def dropout_keep_mask(key: Array, shape: tuple[int, ...], keep_prob: float) -> Array:
  """A bool mask of `shape` whose entries are True with probability keep_prob, independently.

  Each entry hashes its flat index with 64 bits drawn from `key` (two rounds of MurmurHash3's
  finaliser): a dozen integer ops per entry, where threefry costs over a hundred. The index
  comes from iotas, so a sharded mask is the same however the array is split over devices.
  Arrays past 2**32 entries reuse indices.
  """
  seed = jax.random.bits(key, (2,), jnp.uint32)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride = stride * shape[axis] % 2**32
  bits = _mix32(_mix32(index ^ seed[0]) ^ seed[1])
  return bits < jnp.uint32(min(round(keep_prob * 2**32), 2**32 - 1))


class HashDropout(nn.Module):
  """Inverted dropout with `dropout_keep_mask` and the 'dropout' RNG stream, as `nn.Dropout`."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    keep_prob = 1.0 - self.rate
    # No mask is stored: XLA fuses the hash into the ops that apply it, forward and backward.
    keep = dropout_keep_mask(self.make_rng('dropout'), x.shape, keep_prob)
    return jnp.where(keep, x / keep_prob, 0).astype(x.dtype)
