"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs").

Softmax attention weighs value v_k by exp(q.k); linear attention by phi(q).phi(k) with the
feature map phi(x) = elu(x) + 1 (positive, so the weights of a query still sum to 1 after
normalising):

  out_q = phi(q)^T S / phi(q)^T z,   S = sum_k phi(k) v_k^T [head_dim, head_dim],
                                     z = sum_k phi(k) [head_dim].

S and z are summed once and read by every query: cost linear in the length. Causal attention
sums over keys up to the query, a prefix sum in training; in decoding (S, z) is a recurrent
state of constant size that each step adds its key and value to, instead of a key/value cache
that grows by one entry per step.

Here S and z travel together as one array `state` [..., heads, head_dim, head_dim + 1] (the
values with a column of ones appended), in float32.

Packed rows: a query reads only the keys of its own segment. Segment ids are 0 at padding
and 1, 2, ... for the segments of a row in order (an unpacked row is one segment: tokens > 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, in float32."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1


def _outer(keys: Array, values: Array, key_valid: Array) -> Array:
  """phi(k) [v, 1]^T per key, zero at invalid keys.

  Args:
    keys, values: [batch, k_len, heads, head_dim].
    key_valid: [batch, k_len] bool.
  Returns:
    [batch, k_len, heads, head_dim, head_dim + 1] float32.
  """
  features = feature_map(keys) * key_valid[:, :, None, None]
  values = values.astype(jnp.float32)
  values_and_one = jnp.concatenate([values, jnp.ones(values.shape[:-1] + (1,), jnp.float32)],
                                   axis=-1)
  return jnp.einsum('bkhd,bkhe->bkhde', features, values_and_one)


def read(query: Array, state: Array) -> Array:
  """phi(q)^T S / phi(q)^T z for each query.

  Args:
    query: [..., heads, head_dim].
    state: [..., heads, head_dim, head_dim + 1], broadcastable against the query's leading axes.
  Returns:
    [..., heads, head_dim] float32; 0 where no key was summed (padding queries).
  """
  read_out = jnp.einsum('...hd,...hde->...he', feature_map(query), state)
  numerator, denominator = read_out[..., :-1], read_out[..., -1:]
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, numerator / safe, 0.0)


def _segment_bounds(query_segments: Array, key_segments: Array) -> tuple[Array, Array]:
  """For each query, the first and last key index of its own segment.

  Args:
    query_segments: [batch, q_len] int, 0 at padding.
    key_segments: [batch, k_len] int, 0 at padding.
  Returns:
    first, last: [batch, q_len] int32; first > last when the segment has no key.
  """
  k_len = key_segments.shape[1]
  same = (query_segments[:, :, None] == key_segments[:, None, :]) & (query_segments > 0)[..., None]
  index = jnp.arange(k_len, dtype=jnp.int32)
  first = jnp.min(jnp.where(same, index, k_len), axis=-1)
  last = jnp.max(jnp.where(same, index, -1), axis=-1)
  return first, last


def attention(query: Array, keys: Array, values: Array, query_segments: Array,
              key_segments: Array, causal: bool, packed: bool) -> Array:
  """Linear attention of every query over the keys of its segment (up to itself if `causal`).

  Args:
    query: [batch, q_len, heads, head_dim].
    keys, values: [batch, k_len, heads, head_dim].
    query_segments: [batch, q_len] int, 0 at padding (see the module docstring).
    key_segments: [batch, k_len] int.
    causal: query i reads keys j <= i only (self-attention: q_len == k_len).
    packed: rows may hold several segments; False promises one segment per row.
  Returns:
    [batch, q_len, heads, head_dim] float32; 0 at padding queries.
  """
  outer = _outer(keys, values, key_segments > 0)
  query_valid = (query_segments > 0)[:, :, None, None]
  if not (causal or packed):  # Every query reads the row's whole sum.
    return read(query, jnp.sum(outer, axis=1)[:, None]) * query_valid
  first, last = _segment_bounds(query_segments, key_segments)
  if causal:  # Keys of the query's segment up to the query itself.
    last = jnp.minimum(last, jnp.arange(query.shape[1], dtype=jnp.int32))
  # Prefix sums with a zero in front: keys first..last sum to prefix[last+1] - prefix[first].
  prefix = jnp.pad(jnp.cumsum(outer, axis=1), [(0, 0), (1, 0)] + [(0, 0)] * 3)
  take = lambda i: jnp.take_along_axis(prefix, i[:, :, None, None, None], axis=1)
  empty = first > last
  state = take(jnp.where(empty, 0, last + 1)) - take(jnp.where(empty, 0, first))
  return read(query, state) * query_valid


def weights(query: Array, keys: Array, mask: Array) -> Array:
  """The attention weights linear attention implies: phi(q).phi(k), normalised over the allowed
  keys; float32 [batch, heads, q_len, k_len] (rows of no allowed key are 0).

  Args:
    query: [batch, q_len, heads, head_dim]; keys: [batch, k_len, heads, head_dim].
    mask: bool, broadcastable to [batch, heads, q_len, k_len].
  """
  scores = jnp.einsum('bqhd,bkhd->bhqk', feature_map(query), feature_map(keys))
  scores = jnp.where(mask, scores, 0.0)
  total = jnp.sum(scores, axis=-1, keepdims=True)
  return scores / jnp.where(total > 0, total, 1.0)


def quadratic_attention(query: Array, keys: Array, values: Array, mask: Array) -> Array:
  """The same attention computed through its [q_len, k_len] weights (for tests and pictures).

  Args:
    query: [batch, q_len, heads, head_dim]; keys, values: [batch, k_len, heads, head_dim].
    mask: bool, broadcastable to [batch, heads, q_len, k_len].
  Returns:
    [batch, q_len, heads, head_dim] float32.
  """
  return jnp.einsum('bhqk,bkhd->bqhd', weights(query, keys, mask), values.astype(jnp.float32))


def initial_state(shape: tuple[int, ...], heads: int, head_dim: int) -> Array:
  """An empty recurrent state: zeros [*shape, heads, head_dim, head_dim + 1] float32."""
  return jnp.zeros(shape + (heads, head_dim, head_dim + 1), jnp.float32)


def summed_state(keys: Array, values: Array, key_valid: Array) -> Array:
  """The state of all valid keys: [batch, heads, head_dim, head_dim + 1] (cross-attention)."""
  return jnp.sum(_outer(keys, values, key_valid), axis=1)


def add_to_state(state: Array, keys: Array, values: Array) -> Array:
  """The recurrent update S += phi(k) v^T, z += phi(k) of one decoding step.

  Args:
    state: [batch, beam, heads, head_dim, head_dim + 1].
    keys, values: [batch, beam, heads, head_dim], this step's.
  """
  batch, beam = keys.shape[:2]
  flat = lambda t: t.reshape((batch * beam, 1) + t.shape[2:])
  outer = _outer(flat(keys), flat(values), jnp.ones((batch * beam, 1), bool))
  return state + outer.reshape(state.shape)
