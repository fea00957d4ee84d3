"""Sparse probability maps for attention: sparsemax and 1.5-entmax.

Both map scores z [..., n] onto the probability simplex and, unlike softmax, give exact zeros
to low scores:

  sparsemax(z) = argmin_{p in simplex} ||p - z||^2 = max(z - tau, 0)
                 (Martins & Astudillo, 2016);
  entmax15(z)  = max(z / 2 - tau, 0)^2
                 (Peters, Niculae & Martins, 2019, alpha = 1.5),

with the threshold tau that makes the entries sum to 1, found exactly from the sorted scores.
Their derivatives are defined by `jax.custom_jvp` (reverse mode follows by transposition): with
s = 1 on the support for sparsemax and s = sqrt(p) for entmax15,
  dp = s * (dz - sum(s * dz) / sum(s)).

Scores far below the largest one get probability 0 whatever their exact value, so masked
scores (-inf or the float minimum) are clamped first, which keeps the arithmetic finite. A row
whose scores are all equal (every key masked included) is uniform, as softmax gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# After subtracting the row's maximum, scores are clamped to this: far below any threshold
# (tau >= max - 1 for sparsemax, max/2 - tau <= 1 for entmax15), so the result is exact.
_FLOOR = -1e4


def _shifted(z: Array) -> Array:
  """z - max(z) along the last axis, clamped to _FLOOR, in float32."""
  z = z.astype(jnp.float32)
  return jnp.maximum(z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True)), _FLOOR)


def _jvp(p: Array, s: Array, dz: Array) -> Array:
  """s * (dz - sum(s * dz) / sum(s)) along the last axis."""
  return s * (dz - jnp.sum(s * dz, axis=-1, keepdims=True) / jnp.sum(s, axis=-1, keepdims=True))


@jax.custom_jvp
def _sparsemax(z: Array) -> Array:
  n = z.shape[-1]
  sorted_z = -jnp.sort(-z, axis=-1)  # Descending.
  cumulative = jnp.cumsum(sorted_z, axis=-1)
  k = jnp.arange(1, n + 1, dtype=z.dtype)
  support_size = jnp.sum(1 + k * sorted_z > cumulative, axis=-1, keepdims=True)
  tau = (jnp.take_along_axis(cumulative, support_size - 1, axis=-1) - 1) / support_size
  return jnp.maximum(z - tau, 0)


@_sparsemax.defjvp
def _sparsemax_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  p = _sparsemax(z)
  return p, _jvp(p, (p > 0).astype(p.dtype), dz)


@jax.custom_jvp
def _entmax15(z: Array) -> Array:
  n = z.shape[-1]
  z = z / 2
  sorted_z = -jnp.sort(-z, axis=-1)
  k = jnp.arange(1, n + 1, dtype=z.dtype)
  mean = jnp.cumsum(sorted_z, axis=-1) / k
  mean_square = jnp.cumsum(sorted_z**2, axis=-1) / k
  # With the k largest scores in the support, tau solves sum_j (z_j - tau)^2 = 1 over them.
  delta = (1 - k * (mean_square - mean**2)) / k
  tau_k = mean - jnp.sqrt(jnp.maximum(delta, 0))
  support_size = jnp.sum(tau_k <= sorted_z, axis=-1, keepdims=True)
  tau = jnp.take_along_axis(tau_k, support_size - 1, axis=-1)
  return jnp.maximum(z - tau, 0) ** 2


@_entmax15.defjvp
def _entmax15_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  p = _entmax15(z)
  return p, _jvp(p, jnp.sqrt(p), dz)


def sparsemax(z: Array) -> Array:
  """Sparsemax over the last axis: [..., n] -> float32 probabilities [..., n]."""
  return _sparsemax(_shifted(z))


def entmax15(z: Array) -> Array:
  """1.5-entmax over the last axis: [..., n] -> float32 probabilities [..., n]."""
  return _entmax15(_shifted(z))
