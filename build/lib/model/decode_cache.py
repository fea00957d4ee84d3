"""The Transformer's incremental-decoding caches: plain dicts of arrays, passed in and returned.

Three layouts, by the config:
  * the paper's attention: decoder self-attention keys/values of every step so far,
    'self_keys'/'self_values' [batch, beam, steps, heads, head_dim], and the cross-attention
    keys/values of the encoder output, 'cross_keys'/'cross_values' [batch, src_len, heads,
    head_dim], projected once per source sentence and shared by its beams;
  * on the CPU (`config.use_cpu_decoding`): `model/cpu/decoding.py`'s layout;
  * linear attention: a state of constant size per layer, 'self_state' [batch, beam, heads,
    head_dim, head_dim + 1] and 'cross_state' [batch, heads, head_dim, head_dim + 1].
Each holds 'encoder_mask' [batch, src_len] bool and 'layers', one dict per decoder layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model import linear_attention
from model.backend import dense_apply
from model.config import TransformerConfig
from model.cpu import decoding as cpu_decoding

Array = jax.Array
Cache = dict[str, Any]


def init(config: TransformerConfig, cross: list[tuple[Array, Array]], inputs: Array,
         beam_size: int, max_length: int) -> Cache:
  """The cache for `beam_size` hypotheses per source sentence and `max_length` steps.

  Args:
    cross: per decoder layer, cross-attention keys and values [batch, src_len, heads, head_dim].
    inputs: [batch, src_len] source ids (0 = padding).
  """
  c = config
  if c.linear_attention:
    self_state = linear_attention.initial_state((inputs.shape[0], beam_size), c.num_heads,
                                                c.head_dim)
    layers = [dict(self_state=self_state,
                   cross_state=linear_attention.summed_state(keys, values, inputs > 0))
              for keys, values in cross]
    return {'encoder_mask': inputs > 0, 'layers': layers}
  if c.use_cpu_decoding:
    return cpu_decoding.init_cache(cross, inputs > 0, beam_size, max_length, c.num_heads,
                                   c.head_dim, c.dtype)
  empty = jnp.zeros((inputs.shape[0], beam_size, max_length, c.num_heads, c.head_dim), c.dtype)
  layers = [dict(self_keys=empty, self_values=empty, cross_keys=keys, cross_values=values)
            for keys, values in cross]
  return {'encoder_mask': inputs > 0, 'layers': layers}


def self_attention_mask(config: TransformerConfig, cache: Cache,
                        step: Array) -> tuple[Array | None, Cache]:
  """Which cached self-attention entries the hypotheses of decoding step `step` read (None
  with linear attention, whose states hold exactly that), and the cache to step with."""
  if config.linear_attention:
    return None, cache
  if config.use_cpu_decoding:
    return cpu_decoding.self_attention_mask(cache, step)
  steps = cache['layers'][0]['self_keys'].shape[2]
  return (jnp.arange(steps) <= step)[None, None, None, :], cache


def self_attention_step(attention: Any, x: Array, step: Array, layer_cache: Cache,
                        mask: Array | None) -> tuple[Array, Cache]:
  """A decoder layer's self-attention in one decoding step, on its cache's layout.

  Args:
    attention: the layer's bound `MultiHeadAttention`.
    x: [batch, beam, d_model], this step's inputs of every hypothesis.
    step: scalar int (or, on the CPU layout, [batch]), the position being decoded.
    layer_cache: the layer's part of the cache.
    mask: from `self_attention_mask`.
  Returns:
    [batch, beam, d_model] and the cache entries this step wrote.
  """
  config = attention.config
  if config.linear_attention:  # Add this step's key/value to the state, then read it.
    keys, values = attention.project_keys_values(x)
    state = linear_attention.add_to_state(layer_cache['self_state'], keys, values)
    return linear_read(attention, x, state), {'self_state': state}
  if config.use_cpu_decoding:
    return cpu_decoding.self_attention_step(attention, x, step, layer_cache, mask)
  new_keys, new_values = attention.project_keys_values(x)  # [batch, beam, heads, head_dim]
  keys = jax.lax.dynamic_update_slice_in_dim(layer_cache['self_keys'], new_keys[:, :, None],
                                             step, axis=2)
  values = jax.lax.dynamic_update_slice_in_dim(layer_cache['self_values'],
                                               new_values[:, :, None], step, axis=2)
  batch, beam = x.shape[:2]
  rows = lambda t: t.reshape((batch * beam,) + t.shape[2:])  # Hypotheses as the batch.
  out = attention.attend(rows(x)[:, None], rows(keys), rows(values), mask, train=False)
  return out.reshape(x.shape), {'self_keys': keys, 'self_values': values}


def cross_attention_step(attention: Any, x: Array, layer_cache: Cache, mask: Array) -> Array:
  """A decoder layer's attention over the source in one decoding step: x [batch, beam,
  d_model] -> [batch, beam, d_model]; mask [batch, 1, 1, src_len] bool."""
  config = attention.config
  if config.linear_attention:
    return linear_read(attention, x, layer_cache['cross_state'])
  if config.use_cpu_decoding:
    return cpu_decoding.cross_attention_step(attention, x, layer_cache, mask)
  return attention.attend(x, layer_cache['cross_keys'], layer_cache['cross_values'], mask, False)


def linear_read(attention: Any, x: Array, state: Array) -> Array:
  """Linear attention of x [batch, beam, d_model] over a summed state: [batch, beam, heads,
  head_dim, head_dim + 1] (self-attention) or [batch, heads, ...] (the source's, shared)."""
  config = attention.config
  if state.ndim == 4:
    state = state[:, None]
  context = linear_attention.read(dense_apply(config, attention.query, x), state)
  return dense_apply(config, attention.out, context.astype(config.dtype), feature_dims=2)
