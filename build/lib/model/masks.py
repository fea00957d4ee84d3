"""Which positions attend to which: padding, packed segments, causality; and the decoder's
shifted inputs and per-segment positions of packed rows."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.config import TransformerConfig
from model.tokens import PAD_ID

Array = jax.Array


def shift_right(targets: Array, segmentation: Array | None = None) -> Array:
  """Decoder inputs: targets shifted right by one with the start symbol 0, per packed segment.

  Args:
    targets: [batch, length] int.
    segmentation: [batch, length] segment ids of packed rows, or None.
  Returns:
    [batch, length] int, 0 at the start of every segment.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    previous_segment = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segmentation == previous_segment, shifted, PAD_ID)
  return shifted


def positions_from_segmentation(segmentation: Array) -> Array:
  """Position of every token within its packed segment: [batch, length] int32.

  A segment starts wherever the id differs from the previous token's.
  """
  index = jnp.broadcast_to(jnp.arange(segmentation.shape[1], dtype=jnp.int32),
                           segmentation.shape)
  previous = jnp.pad(segmentation, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
  starts = jnp.where(segmentation != previous, index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def attention_mask(query_tokens: Array, key_tokens: Array,
                   query_segmentation: Array | None = None,
                   key_segmentation: Array | None = None,
                   causal: bool = False) -> Array:
  """Boolean mask [batch, 1, query_length, key_length]: True where attention is allowed.

  Blocks padding keys and queries (id 0), attention across packed segments, and with
  `causal` every key after the query.
  """
  mask = (query_tokens > 0)[:, None, :, None] & (key_tokens > 0)[:, None, None, :]
  if query_segmentation is not None:
    mask &= query_segmentation[:, None, :, None] == key_segmentation[:, None, None, :]
  if causal:
    q_len, k_len = query_tokens.shape[1], key_tokens.shape[1]
    mask &= jnp.arange(q_len)[:, None] >= jnp.arange(k_len)[None, :]
  return mask


class LinearMask(NamedTuple):
  """What linear attention needs instead of a [q_len, k_len] mask (model/linear_attention.py).

  query_segments [batch, q_len] and key_segments [batch, k_len] int: 0 at padding, else the
  packed segment id (1 for every token of an unpacked row); `causal` and `packed` as there.
  """

  query_segments: Array
  key_segments: Array
  causal: bool
  packed: bool

  def dense(self) -> Array:
    """The same as a bool mask [batch, 1, q_len, k_len]."""
    query, key = self.query_segments, self.key_segments
    mask = (query[:, None, :, None] == key[:, None, None, :]) & (query > 0)[:, None, :, None]
    if self.causal:
      mask &= jnp.arange(query.shape[1])[:, None] >= jnp.arange(key.shape[1])[None, :]
    return mask


def segment_ids(tokens: Array, segmentation: Array | None) -> Array:
  """[batch, length] int32: 0 at padding, else the token's segment (1 in unpacked rows)."""
  real = tokens > 0
  if segmentation is None:
    return real.astype(jnp.int32)
  return jnp.where(real, segmentation, 0).astype(jnp.int32)


def make_mask(config: TransformerConfig, query_tokens: Array, key_tokens: Array,
              query_segmentation: Array | None = None, key_segmentation: Array | None = None,
              causal: bool = False) -> Array | LinearMask:
  """`attention_mask`, or with `config.linear_attention` its `LinearMask`."""
  if config.linear_attention:
    return LinearMask(segment_ids(query_tokens, query_segmentation),
                      segment_ids(key_tokens, key_segmentation), causal,
                      packed=query_segmentation is not None)
  return attention_mask(query_tokens, key_tokens, query_segmentation, key_segmentation, causal)


def default_positions(tokens: Array, segmentation: Array | None) -> Array:
  """Positions within each packed segment, or 0, 1, ... along each row: [batch, length]."""
  if segmentation is not None:
    return positions_from_segmentation(segmentation)
  return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
