"""Dense layers applied to [rows, features]: the rank-2 products XLA:CPU's matmul libraries take.

On [batch, length, features] activations XLA:CPU transposes activations or gradients to form
each weight gradient. Used when `TransformerConfig.cpu_tuned` is on; measured in
BENCHMARKS.md, "Training step" (dense layers on [rows, features]).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

Array = jax.Array


def on_rows(layer: Callable[[Array], Array], x: Array, feature_dims: int = 1) -> Array:
  """layer(x) with x's leading (batch, position) axes flattened into one row axis.

  x: [..., *features] with `feature_dims` feature axes -> layer's output with x's leading axes.
  """
  leading = x.shape[:x.ndim - feature_dims]
  y = layer(x.reshape((-1,) + x.shape[x.ndim - feature_dims:]))
  return y.reshape(leading + y.shape[1:])
