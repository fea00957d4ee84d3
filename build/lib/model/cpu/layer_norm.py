"""Layer normalisation with a written-out derivative: fewer passes over the activations on CPU.

XLA's derivative of the plain forward makes more passes than this rule. The rule is a JVP
(`jax.custom_jvp`), linear in the tangents, so forward mode (`jax.jvp`, `jax.jacfwd`) works
and reverse mode transposes it into the hand-written gradient. Used when
`TransformerConfig.cpu_tuned` is on; measured in BENCHMARKS.md, "Training step" (`LayerNorm`
with a written-out gradient).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _statistics(x: Array, epsilon: float) -> tuple[Array, Array]:
  """x [..., features] -> normalised x (float32) and 1 / std [..., 1] (float32)."""
  x32 = x.astype(jnp.float32)
  centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
  return centred * inv_std, inv_std


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
  """(x - mean) / sqrt(var + epsilon) * scale + bias over the last axis; statistics in float32.

  x: [..., features]; scale, bias: [features]. Returns x's shape and dtype.
  """
  normalised, _ = _statistics(x, epsilon)
  y = normalised * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype)


@layer_norm.defjvp
def _layer_norm_jvp(epsilon, primals, tangents):
  x, scale, bias = primals
  dx, dscale, dbias = tangents
  normalised, inv_std = _statistics(x, epsilon)
  scale32 = scale.astype(jnp.float32)
  y = normalised * scale32 + bias.astype(jnp.float32)
  # d normalised = inv_std * (dx - mean(dx) - normalised * mean(dx * normalised)), per row.
  # The map is self-adjoint, so its transpose (reverse mode) is the same three passes.
  dx = dx.astype(jnp.float32)
  d_normalised = inv_std * (dx - jnp.mean(dx, axis=-1, keepdims=True)
                            - normalised * jnp.mean(dx * normalised, axis=-1, keepdims=True))
  dy = (d_normalised * scale32 + normalised * dscale.astype(jnp.float32)
        + dbias.astype(jnp.float32))
  return y.astype(x.dtype), dy.astype(x.dtype)


class LayerNorm(nn.Module):
  """`nn.LayerNorm`'s parameters ('scale' ones, 'bias' zeros) and results, via `layer_norm`."""

  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = x.shape[-1]
    scale = self.param('scale', nn.initializers.ones, (features,), self.param_dtype)
    bias = self.param('bias', nn.initializers.zeros, (features,), self.param_dtype)
    # Normalise in the wider of the two dtypes, like nn.LayerNorm; return self.dtype.
    x = x.astype(jnp.promote_types(x.dtype, self.dtype))
    return layer_norm(x, scale, bias, self.epsilon).astype(self.dtype)
