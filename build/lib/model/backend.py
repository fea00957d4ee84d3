"""The primitives the Transformer chooses by backend: the paper's operation, or its CPU-tuned
twin (`model/cpu/`, same parameters and, up to rounding, the same results) when
`TransformerConfig.use_cpu_tuned` holds. GPU and TPU runs take the paper's operation."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from model.config import TransformerConfig
from model.cpu.dropout import HashDropout
from model.cpu.layer_norm import LayerNorm as CpuLayerNorm
from model.cpu.rows import on_rows

Array = jax.Array


def dropout(config: TransformerConfig, rate: float) -> nn.Module:
  """Inverted dropout (Section 5.4): `nn.Dropout`, or `HashDropout` when CPU-tuned."""
  return HashDropout(rate) if config.use_cpu_tuned else nn.Dropout(rate)


def layer_norm(config: TransformerConfig) -> nn.Module:
  """Layer normalisation: `nn.LayerNorm`, or its CPU twin (same parameters) when CPU-tuned."""
  norm = CpuLayerNorm if config.use_cpu_tuned else nn.LayerNorm
  return norm(epsilon=config.layer_norm_epsilon, dtype=config.dtype,
              param_dtype=config.param_dtype)


def dense_apply(config: TransformerConfig, layer: Callable[[Array], Array], x: Array,
                feature_dims: int = 1) -> Array:
  """layer(x) on x [batch, length, *features]; on rank-2 rows when CPU-tuned."""
  return on_rows(layer, x, feature_dims) if config.use_cpu_tuned else layer(x)
