"""The Transformer's CPU decoding pieces: a self-attention cache beam search never reorders,
a loop over a growing cache, and a top-k over vocabulary blocks.

Used by the Transformer's searches when `TransformerConfig.cpu_tuned` is on; each piece is
measured in BENCHMARKS.md, "Decoding":
  * The self-attention cache is stored as keys [batch, heads, head_dim, steps * beam] and
    values [batch, heads, steps * beam, head_dim], the layouts XLA:CPU's attention products
    read fastest, updated in place. Every hypothesis attends over all beams' entries and a
    mask keeps its own ancestry, read from `slots` [batch, beam, steps] (the beam slot
    holding each step's ancestor): beam search reorders this small int index instead of the
    cache.
  * Cross-attention keys are carried as [batch, heads, head_dim, src_len] (zero-padded to a
    multiple of 32 positions), values as [batch, heads, src_len, head_dim] (`carry_keys`,
    `CARRIED_VALUES`), behind an optimization barrier, so XLA does not transpose them inside
    every step.
  * The loop runs in pieces over a cache grown between them, so early steps attend over a
    short cache: `CHUNK_LENGTH` steps, then pieces twice as long (`search.chunk_ends`);
    each piece compiles its own loop body. The self-attention cache is a list of chunks, one
    per piece: growing it adds an empty chunk instead of copying the cache into a longer one
    (a copy of the whole cache at every piece, which cost as much as several steps).
  * With a position per sentence (`model/cpu/continuous_batching.py`), each sentence writes its
    step's entries into the chunk that holds them; a later chunk is read only by the rows
    that reached it, from a gathered copy of those rows when they are few.
  * `block_top_k_extensions` finds the best extensions from the maxima of vocabulary blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.cpu.rows import on_rows

Array = jax.Array
Cache = dict[str, Any]

CHUNK_LENGTH = 8  # Decoding steps of the first loop piece.
# Cross-attention keys, values [batch, src_len, heads, head_dim] -> their carried layouts:
# [batch, heads, head_dim, src_len] and [batch, heads, src_len, head_dim] (XLA:CPU's fastest
# operands of the query-key and weights-values products).
CARRIED_KEYS = (0, 2, 3, 1)
CARRIED_VALUES = (0, 2, 1, 3)
# The carried keys' source axis is zero-padded to a multiple of this: XLA:CPU's batched
# query-key product runs much slower at widths such as 40 than at 64.
KEY_WIDTH_MULTIPLE = 32
# The self-attention cache's chunks use the same layouts: keys [batch, heads, head_dim,
# entries], values [batch, heads, entries, head_dim]; the axis of their entries:
ENTRY_AXIS = {'self_keys': 3, 'self_values': 2}


def empty_chunk(name: str, batch: int, heads: int, head_dim: int, entries: int,
                dtype: Any) -> Array:
  """A chunk of `entries` zeros of the self-attention cache's 'self_keys' or 'self_values'."""
  shape = [batch, heads, head_dim, head_dim]
  shape[ENTRY_AXIS[name]] = entries
  return jnp.zeros(shape, dtype)


def carry_keys(keys: Array) -> Array:
  """Cross-attention keys [batch, src_len, heads, head_dim] as carried: [batch, heads,
  head_dim, width], zeros after src_len (width: src_len rounded up to KEY_WIDTH_MULTIPLE)."""
  src_len = keys.shape[1]
  width = -(-src_len // KEY_WIDTH_MULTIPLE) * KEY_WIDTH_MULTIPLE
  return jnp.pad(keys.transpose(CARRIED_KEYS), [(0, 0)] * 3 + [(0, width - src_len)])


def init_cache(cross: list[tuple[Array, Array]], encoder_mask: Array, width: int, length: int,
               num_heads: int, head_dim: int, dtype: Any) -> Cache:
  """The cache for `width` hypotheses per sentence and `length` steps.

  Args:
    cross: per decoder layer, cross-attention keys and values [batch, src_len, heads, head_dim].
    encoder_mask: [batch, src_len] bool, True at real source tokens.
  Returns:
    {'encoder_mask', 'slots' [batch, width, length] int32, 'layers': per layer 'self_keys',
    'self_values' (lists of chunks of chunk_steps * width entries, `empty_chunk`'s layouts;
    one chunk of `length` steps here, one more per `grow_cache`) and 'cross_keys',
    'cross_values' (`carry_keys`, `CARRIED_VALUES`)}.
  """
  batch = encoder_mask.shape[0]
  empty = {name: [empty_chunk(name, batch, num_heads, head_dim, length * width, dtype)]
           for name in ENTRY_AXIS}
  layers = [dict(**empty, cross_keys=carry_keys(keys),
                 cross_values=values.transpose(CARRIED_VALUES)) for keys, values in cross]
  slots = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :, None],
                           (batch, width, length))
  return {'encoder_mask': encoder_mask, 'slots': slots, 'layers': layers}


def barrier(cache: Cache) -> Cache:
  """Keeps XLA from sinking the transposes of the cross keys/values into the loop body."""
  return jax.lax.optimization_barrier(cache)


def self_attention_mask(cache: Cache, step: Array) -> tuple[Array, Cache]:
  """Which cached entries each hypothesis sees at `step` (scalar, or [batch]: a position per
  sentence); marks this step's entry its own.

  Returns the mask [batch, 1, beam, steps * beam] (the cache's order: hypothesis q sees slot s
  at step t iff its ancestor at t lives in slot s) and the cache with `slots` updated.
  """
  slots = cache['slots']
  batch, beam, steps = slots.shape
  time = jnp.arange(steps)
  step = jnp.reshape(step, (-1, 1, 1))  # [1 or batch, 1, 1]
  slots = jnp.where(time == step, jnp.arange(beam, dtype=slots.dtype)[None, :, None], slots)
  visible = (slots[..., None] == jnp.arange(beam)) & (time <= step)[..., None]
  return visible.reshape(batch, 1, beam, steps * beam), {**cache, 'slots': slots}


def reorder_cache(cache: Cache, parents: Array) -> Cache:
  """Beam search's reordering: only the slots index [batch, beam, steps] follows `parents`."""
  slots = jnp.take_along_axis(cache['slots'], parents[:, :, None], axis=1)
  return {**cache, 'slots': slots}


def grow_cache(cache: Cache, length: int) -> Cache:
  """Makes the cache hold `length` steps: an empty chunk for the steps added, the slots
  padded (the chunks already written are kept as they are, not copied)."""
  slots = cache['slots']
  batch, width, steps = slots.shape
  if length <= steps:
    return cache

  def grow(name: str, chunks: list[Array]) -> list[Array]:
    shape = list(chunks[0].shape)
    shape[ENTRY_AXIS[name]] = (length - steps) * width
    return [*chunks, jnp.zeros(shape, chunks[0].dtype)]

  layers = [{**layer, **{name: grow(name, layer[name]) for name in ENTRY_AXIS}}
            for layer in cache['layers']]
  slots = jnp.pad(slots, [(0, 0), (0, 0), (0, length - steps)])
  return {**cache, 'slots': slots, 'layers': layers}


def _project_query_keys_values(attention, x: Array) -> tuple[Array, Array, Array]:
  """attention's query, key and value projections of x [batch, beam, d_model] as one product
  with the three kernels side by side (XLA:CPU runs a [rows, 3 * d_model] product much faster
  than three [rows, d_model] ones). Returns three [batch, beam, heads, head_dim]."""
  dtype = attention.config.dtype
  layers = (attention.query, attention.key, attention.value)
  kernels = [layer.variables['params']['kernel'] for layer in layers]
  _, heads, head_dim = kernels[0].shape
  kernel = jnp.concatenate([k.reshape(k.shape[0], -1) for k in kernels], axis=1).astype(dtype)
  biases = [layer.variables['params'].get('bias') for layer in layers]
  bias = jnp.concatenate([jnp.zeros((heads, head_dim), dtype) if b is None else b.astype(dtype)
                          for b in biases], axis=None)
  rows = x.reshape(-1, x.shape[-1]).astype(dtype)
  projected = (rows @ kernel + bias).reshape(x.shape[:-1] + (3, heads, head_dim))
  return projected[..., 0, :, :], projected[..., 1, :, :], projected[..., 2, :, :]


def self_attention_step(attention, x: Array, step: Array, layer_cache: Cache,
                        mask: Array) -> tuple[Array, Cache]:
  """One decoding step of `attention` (a bound MultiHeadAttention) over the transposed cache.

  Args:
    x: [batch, beam, d_model], this step's inputs of every hypothesis.
    step: scalar int, the position being decoded (within the last chunk: the loop's piece);
      or [batch] int, each sentence's own position (continuous batching): each entry is
      written into the chunk holding it, and a later chunk is read only by the sentences
      that reached it.
    layer_cache: 'self_keys'/'self_values', lists of chunks of chunk_steps * beam entries
      (`empty_chunk`) that together hold steps * beam entries.
    mask: from `self_attention_mask`.
  Returns:
    [batch, beam, d_model] and the updated 'self_keys'/'self_values'.
  """
  query, keys, values = _project_query_keys_values(attention, x)
  batch, beam = keys.shape[:2]
  starts = np.cumsum([0] + [chunk.shape[3] for chunk in layer_cache['self_keys']])
  updates = {'self_keys': keys, 'self_values': values}  # [batch, beam, heads, head_dim]
  if jnp.ndim(step) == 0:
    # This step's entries of all slots are contiguous: one in-place update of the last chunk.
    layout = {'self_keys': (0, 2, 3, 1), 'self_values': (0, 2, 1, 3)}
    new = {name: [*layer_cache[name][:-1], jax.lax.dynamic_update_slice_in_dim(
        layer_cache[name][-1], update.transpose(layout[name]), step * beam - starts[-2],
        axis=ENTRY_AXIS[name])] for name, update in updates.items()}
    readers = [None] * len(starts[:-1])
  else:
    new = {name: [_write_rows(chunk, update, step * beam - start, ENTRY_AXIS[name])
                  for chunk, start in zip(layer_cache[name], starts)]
           for name, update in updates.items()}
    readers = [None] + [_readers(step * beam >= start) for start in starts[1:-1]]
  if attention.config.attention_score == 'additive':
    query = query.transpose(0, 2, 1, 3)
    score = attention.additive_scores
  else:
    query = attention.score_query(query).transpose(0, 2, 1, 3)
    score = lambda query, chunk: jnp.einsum('bhqd,bhdk->bhqk', query, chunk,
                                            preferred_element_type=jnp.float32)
  chunk_logits = [_on_readers(rows, score, query, chunk) for rows, chunk in
                  zip(readers, new['self_keys'])]
  weights = attention.weights(jnp.concatenate(chunk_logits, axis=-1), mask)
  parts = jnp.split(weights, starts[1:-1], axis=-1)
  read = lambda chunk, part: jnp.einsum('bhkd,bhqk->bqhd', chunk, part)
  context = sum(_on_readers(rows, read, chunk, part)
                for rows, chunk, part in zip(readers, new['self_values'], parts))
  return on_rows(attention.out, context, feature_dims=2), new


def cross_attention_step(attention, x: Array, layer_cache: Cache, mask: Array) -> Array:
  """One decoding step of cross-attention (a bound MultiHeadAttention) over the carried
  keys/values, with the products `self_attention_step` uses (XLA:CPU runs them on this layout
  without a transpose).

  Args:
    x: [batch, beam, d_model], this step's inputs of every hypothesis (the beam axis plays
      the query axis: one source per sentence).
    layer_cache: 'cross_keys' [batch, heads, head_dim, width >= src_len] (`carry_keys`),
      'cross_values' [batch, heads, src_len, head_dim].
    mask: [batch, 1, 1, src_len] bool.
  Returns:
    [batch, beam, d_model].
  """
  query = on_rows(attention.query, x)  # [batch, beam, heads, head_dim]
  if attention.config.attention_score == 'additive':
    logits = attention.additive_scores(query.transpose(0, 2, 1, 3), layer_cache['cross_keys'])
  else:
    logits = jnp.einsum('bhqd,bhdk->bhqk', attention.score_query(query).transpose(0, 2, 1, 3),
                        layer_cache['cross_keys'], preferred_element_type=jnp.float32)
  # Logits of the keys' zero padding (`carry_keys`) are dropped.
  weights = attention.weights(logits[..., :mask.shape[-1]], mask)
  context = jnp.einsum('bhkd,bhqk->bqhd', layer_cache['cross_values'], weights)
  return on_rows(attention.out, context, feature_dims=2)


def _write_rows(chunk: Array, update: Array, offsets: Array, axis: int) -> Array:
  """chunk [batch, heads, ...] (its entries on `axis`, 2 or 3) with row b's `beam` entries
  from offsets[b] set to update [batch, beam, heads, head_dim]; offsets outside the chunk
  write nothing."""
  batch, entries = chunk.shape[0], chunk.shape[axis]
  index = offsets[:, None] + jnp.arange(update.shape[1])  # [batch, beam]
  index = jnp.where((offsets >= 0)[:, None] & (index < entries), index, entries)
  where = [jnp.arange(batch)[:, None], slice(None), slice(None), slice(None)]
  where[axis] = index  # Indexed axes apart: [batch, beam] lead the updated slice's shape.
  return chunk.at[tuple(where)].set(update, mode='drop')


# At most this fraction of the sentences read a later chunk from a gathered copy of their rows
# (more: every row reads it, as a batch does).
_GATHERED_READERS = 4


def _readers(reached: Array) -> tuple[Array, Array]:
  """Which sentences read a cache chunk, from reached [batch] bool: (how they read it: 0 none,
  1 the rows `rows` only, 2 all rows; rows [batch // _GATHERED_READERS], the reached ones
  first, then repeats of the first of them)."""
  size = max(1, reached.shape[0] // _GATHERED_READERS)
  rows = jnp.nonzero(reached, size=size, fill_value=jnp.argmax(reached))[0]
  count = jnp.sum(reached, dtype=jnp.int32)
  return (count > 0).astype(jnp.int32) + (count > size).astype(jnp.int32), rows


def _on_readers(readers: tuple[Array, Array] | None, compute: Any, *operands: Array) -> Array:
  """compute(*operands) [batch, ...] (each operand [batch, ...]) for the rows that read a
  chunk; zeros for the others (a chunk a sentence has not reached holds no entry it sees: its
  logits are masked out and its share of the context is zero). None: every row reads it."""
  if readers is None:
    return compute(*operands)
  how, rows = readers
  shape = jax.eval_shape(compute, *operands)
  zeros = lambda *_: jnp.zeros(shape.shape, shape.dtype)
  gathered = lambda *xs: zeros().at[rows].set(compute(*(x[rows] for x in xs)))
  return jax.lax.switch(how, [zeros, gathered, compute], *operands)


_BLOCK = 128  # Block size when no divisor of the vocabulary fits.


def block_size(vocab: int) -> int:
  """The largest divisor of `vocab` in [64, 256] (blocks then need no padding copy), or _BLOCK."""
  return next((b for b in range(256, 63, -1) if vocab % b == 0), _BLOCK)


def block_top_k_extensions(log_probs: Array, hypothesis_log_probs: Array, allowed: Array,
                           k: int, from_logits: bool = False) -> tuple[Array, Array]:
  """`decoding.top_k_extensions` without scoring or sorting every extension; equal, ties and all.

  The maximum of each vocabulary block of each hypothesis (one reduction); the k best blocks
  by the score of their maximum, which hold the k best extensions (a block holding one of them
  has a maximum that fewer than k extensions beat, each in its own block); top_k over those k
  blocks only. A score rounds monotonically in its input, so a block's best score is its
  maximum's score.

  Args:
    log_probs: [batch, beam, vocab] float32; with `from_logits`, logits instead, normalised
      here for the selected blocks only (with `jax.nn.log_softmax`'s arithmetic, so the scores
      are bit-identical): the Transformer's CPU beam search passes logits.
    hypothesis_log_probs: [batch, beam] float32, -inf for no hypothesis.
    allowed: [batch, 1, vocab] bool, the tokens the rules allow.
    k: how many extensions.
  Returns:
    scores [batch, k] (best first) and flat indices [batch, k] into [beam, vocab].
  """
  batch, beam, vocab = log_probs.shape
  size = block_size(vocab)
  if k * size >= beam * vocab:  # Small vocabularies: the blocks would be all of it.
    if from_logits:
      log_probs = jax.nn.log_softmax(log_probs, axis=-1)
    scores = hypothesis_log_probs[:, :, None] + jnp.where(allowed, log_probs, -jnp.inf)
    return jax.lax.top_k(scores.reshape(batch, -1), k)
  if from_logits:
    row_max = jnp.max(log_probs, axis=-1)  # [batch, beam]
    shifted_log_sum = jnp.log(jnp.sum(jnp.exp(log_probs - row_max[..., None]), axis=-1))
  blocks = -(-vocab // size)
  masked = jnp.where(allowed, log_probs, -jnp.inf)
  if blocks * size > vocab:  # Costs a copy of the log-probs: only when no divisor fits.
    masked = jnp.pad(masked, [(0, 0), (0, 0), (0, blocks * size - vocab)],
                     constant_values=-jnp.inf)
  masked = masked.reshape(batch, beam * blocks, size)

  def score(x: Array, rows: Array) -> Array:  # x [batch, n, ...] of hypotheses rows [batch, n].
    take = lambda t: jnp.take_along_axis(t, rows, axis=1).reshape(
        rows.shape + (1,) * (x.ndim - 2))
    if from_logits:
      x = (x - take(row_max)) - take(shifted_log_sum)
    return take(hypothesis_log_probs) + x

  block_rows = jnp.broadcast_to(jnp.arange(beam * blocks) // blocks, (batch, beam * blocks))
  _, best_blocks = jax.lax.top_k(score(jnp.max(masked, axis=-1), block_rows), k)
  # In index order, so that top_k breaks ties between blocks as it would on all the scores.
  best_blocks = jnp.sort(best_blocks, axis=1)
  candidates = score(jnp.take_along_axis(masked, best_blocks[..., None], axis=1),
                     best_blocks // blocks)  # [batch, k, size]
  scores, position = jax.lax.top_k(candidates.reshape(batch, k * size), k)
  block = jnp.take_along_axis(best_blocks, position // size, axis=1)
  # A padding entry (-inf) is only chosen when fewer than k extensions are allowed; any
  # -inf pick is as good as another, so clamp it into the vocabulary.
  token = jnp.minimum((block % blocks) * size + position % size, vocab - 1)
  return scores, (block // blocks) * vocab + token
