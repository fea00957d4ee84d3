"""Beam search over a pool of sentence slots, each refilled as soon as its sentence ends.

A batch search (`search.beam_search`) runs every sentence of a batch until the slowest one
ends: on real text nearly half of its hypothesis-steps decode sentences already done. Here
the loop runs `slots` sentences at a time, each at its own position; a slot whose sentence
ends takes the next sentence of the queue at the next step, so every step decodes running
sentences until the queue is empty. The queue's sentences are packed into rows, first fit,
and encoded once, up front; blocks of rows that hold no sentence are skipped.

Each sentence's search is `beam_search`'s (`search.beam_step`, the same stopping rules,
length limits and scores); only the steps at which its neighbours start and end differ. It
runs on the CPU decoding cache (`model/cpu/decoding.py`) with a position per sentence, whose
self-attention chunks no running sentence has reached are skipped.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.cpu import decoding as cpu_decoding
from model.search import (
    NEG_INF,
    STOPPING_RULES,
    beam_step,
    check_alpha,
    check_min_length,
    chunk_ends,
    length_penalty,
)
from model.tokens import PAD_ID
from model.transformer import Transformer

Array = jax.Array

# The queue's packed rows are encoded in blocks of at most this many positions.
ENCODER_BLOCK_POSITIONS = 4096
# Steps of the self-attention cache's first chunk, which every running sentence reads (the
# batch search grows its cache from cpu_decoding.CHUNK_LENGTH steps; here all chunks exist
# from the start, and one chunk of 16 steps reads faster than two of 8).
FIRST_CHUNK_LENGTH = 16


def pack_queue(sources: Array) -> dict[str, Array]:
  """The queue's sentences packed into rows for the encoder, first fit in queue order, and
  where each sentence's tokens went (traceable: the search packs its queue itself).

  sources: [queue, width] int32, a sentence per row (EOS included) then PAD_ID; all PAD_ID
    for none.
  Returns {'sources': [queue, width] int32, the packed rows (rows no sentence needed are
  padding), 'segmentation': [queue, width] int32 (sentence i's tokens i + 1, padding 0),
  'origin': [queue, width] int32, the flat index into the packed rows of sentence i's j-th
  token, -1 past its end}.
  """
  queue, width = sources.shape
  lengths = jnp.sum(sources != PAD_ID, axis=1, dtype=jnp.int32)

  def place(i, carry):  # Sentence i goes to the first row with room for it.
    free, starts = carry
    row = jnp.argmax(free >= lengths[i]).astype(jnp.int32)
    return free.at[row].add(-lengths[i]), starts.at[i].set(row * width + width - free[row])

  _, starts = jax.lax.fori_loop(0, queue, place, (jnp.full((queue,), width, jnp.int32),
                                                  jnp.zeros((queue,), jnp.int32)))
  positions = jnp.arange(width, dtype=jnp.int32)
  present = positions < lengths[:, None]
  origin = jnp.where(present, starts[:, None] + positions, -1)
  target = jnp.where(present, origin, queue * width).reshape(-1)  # Out of range: dropped.
  scatter = lambda values: jnp.zeros((queue * width,), jnp.int32).at[target].set(
      values.reshape(-1), mode='drop').reshape(queue, width)
  sentence = jnp.broadcast_to(jnp.arange(1, queue + 1, dtype=jnp.int32)[:, None], (queue, width))
  return {'sources': scatter(sources), 'segmentation': scatter(sentence), 'origin': origin}


def transformer_continuous_beam_search(
    model: Transformer, params: Any, sources: Array, count: Array | int, *,
    slots: int, refill: int, beam_size: int = 4, alpha: float = 0.6,
    max_length: int | None = None, max_extra_length: int = 50, nbest: int = 1,
    stopping: str = 'exact', min_length: int = 1) -> tuple[Array, Array]:
  """`transformer_beam_search`'s translations of a queue of sentences, `slots` at a time.

  Args:
    model: a Transformer on the CPU decoding path (`TransformerConfig.use_cpu_decoding`).
    sources: [queue, width] int32, the queue: a sentence per row (EOS included) then PAD_ID,
      in decoding order, then rows of padding (any number: a queue's shape is fixed, its
      count of sentences is not). Longest first leaves the shortest for the end, when slots
      start running empty, and packs the rows the encoder reads (`pack_queue`) tightly.
    count: scalar int, how many sentences of the queue to decode (the rest is padding).
    slots: sentences decoded at once.
    refill: at most this many empty slots take a new sentence per step.
    Others as `transformer_beam_search` (src_len: the queue's width).
  Returns:
    sequences [queue, nbest, max_length] int32 and scores [queue, nbest] float32, as
    `transformer_beam_search`'s (sentences from `count` on: zeros and -inf).
  """
  config = model.config
  if not config.use_cpu_decoding:
    raise ValueError('continuous batching runs on the CPU decoding cache (cpu_tuned, softmax '
                     'attention); use transformer_beam_search.')
  if stopping not in STOPPING_RULES:
    raise ValueError(f'stopping must be one of {STOPPING_RULES}, got {stopping!r}.')
  if not 1 <= nbest <= beam_size:
    raise ValueError(f'need 1 <= nbest <= beam_size, got nbest={nbest}, beam_size={beam_size}.')
  check_min_length(min_length)
  check_alpha(alpha)
  if jnp.ndim(sources) != 2:
    raise ValueError('sources must be token ids [queue, width], a sentence per row; got '
                     f'{type(sources).__name__} of shape {jnp.shape(sources)}.')
  queue = pack_queue(jnp.asarray(sources, jnp.int32))
  origin = queue['origin']
  queue_size, src_len = origin.shape
  if max_length is None:
    max_length = min(src_len + max_extra_length, config.max_len)
  beam, length = beam_size, max_length
  variables = {'params': params}
  source_lengths = jnp.sum(origin >= 0, axis=1, dtype=jnp.int32)
  queue_limits = jnp.minimum(jnp.where(source_lengths > 0, source_lengths + max_extra_length, 1),
                             length)
  queue_mask = origin >= 0

  def cross_keys_values(m, sources, segmentation):
    """Per layer the queue's cross-attention keys/values [rows * width, heads, head_dim], in
    the packed rows' order (`fill` gathers each sentence's). The rows are encoded a block at a
    time: the encoder's [positions, d_ff] activations of a block stay in cache."""
    rows, width = sources.shape
    block = max(d for d in range(1, rows + 1)
                if rows % d == 0 and (d == 1 or d * width <= ENCODER_BLOCK_POSITIONS))
    blocks = lambda x: x.reshape((rows // block, block) + x.shape[1:])
    encode = lambda x: m.decoder.cross_keys_values(m.encode(*x))
    shapes = jax.eval_shape(encode, (sources[:block], segmentation[:block]))
    # A block of padding only (the queue's end) is not encoded: no sentence reads it.
    cross = jax.lax.map(
        lambda x: jax.lax.cond(jnp.any(x[1] != 0), encode,
                               lambda _: jax.tree_util.tree_map(
                                   lambda s: jnp.zeros(s.shape, s.dtype), shapes), x),
        (blocks(sources), blocks(segmentation)))
    flat = lambda x: x.reshape((rows * width,) + x.shape[3:])
    return [(flat(keys), flat(values)) for keys, values in cross]

  cross = model.apply(variables, queue['sources'], queue['segmentation'],
                      method=cross_keys_values)

  state = dict(
      empty_slots(config, slots, src_len, beam, length, nbest),
      sentence=jnp.full((slots,), queue_size, jnp.int32),  # queue_size: an empty slot
      next=jnp.array(0, jnp.int32),
      out_seqs=jnp.zeros((queue_size, nbest, length), jnp.int32),
      out_scores=jnp.full((queue_size, nbest), NEG_INF, jnp.float32))
  count = jnp.minimum(jnp.asarray(count, jnp.int32), queue_size)

  def fill(state: dict[str, Any], size: int) -> dict[str, Any]:
    """Up to `size` empty slots take the next sentences of the queue."""
    empty = state['done']
    slot = jnp.nonzero(empty, size=size, fill_value=slots)[0]
    sentence = state['next'] + jnp.arange(size, dtype=jnp.int32)
    valid = (slot < slots) & (sentence < count)
    slot = jnp.where(valid, slot, slots)  # Out of range: written nowhere.
    sentence = jnp.where(valid, sentence, 0)
    # Each sentence's keys/values [size, src_len, heads, head_dim] from the packed rows.
    take = lambda x: x[jnp.maximum(origin[sentence], 0)]
    state = start_slots(state, slot, [(take(keys), take(values)) for keys, values in cross],
                        queue_mask[sentence], queue_limits[sentence])
    return {**state, 'sentence': state['sentence'].at[slot].set(sentence, mode='drop'),
            'next': state['next'] + jnp.sum(valid, dtype=jnp.int32)}

  def body(state: dict[str, Any]) -> dict[str, Any]:
    state = fill(state, refill)
    running = ~state['done']
    new = step_slots(model, variables, state, alpha=alpha, nbest=nbest, stopping=stopping,
                     min_length=min_length)
    # Sentences that ended this step hand in their result and free their slot.
    ended = running & new['done']
    target = jnp.where(ended, state['sentence'], queue_size)
    new['out_seqs'] = state['out_seqs'].at[target].set(new['fin_seqs'], mode='drop')
    new['out_scores'] = state['out_scores'].at[target].set(new['fin_scores'], mode='drop')
    return new

  state = fill(state, slots)
  state = jax.lax.while_loop(
      lambda s: (s['next'] < count) | ~jnp.all(s['done']), body, state)
  return state['out_seqs'], state['out_scores']


# The slots' state, shared by `transformer_continuous_beam_search` and the HTTP server's slot
# pool (`model/cpu/slot_pool.py`): every leaf has the slots on axis 0.


def empty_slots(config: Any, slots: int, width: int, beam: int, length: int,
                nbest: int) -> dict[str, Any]:
  """`slots` empty slots (done, at step 0) of a beam search of `beam` hypotheses over sources
  of `width` tokens, translations of up to `length` tokens and `nbest` results, on the CPU
  decoding cache of a model with TransformerConfig `config`."""
  ends = chunk_ends(length, FIRST_CHUNK_LENGTH)
  chunks = {name: [cpu_decoding.empty_chunk(name, slots, config.num_heads, config.head_dim,
                                             (end - start) * beam, config.dtype)
                    for start, end in zip([0] + ends[:-1], ends)]
            for name in cpu_decoding.ENTRY_AXIS}
  cross_slot = jnp.zeros((slots, width, config.num_heads, config.head_dim), config.dtype)
  cache = {'encoder_mask': jnp.zeros((slots, width), bool),
           'slots': jnp.broadcast_to(jnp.arange(beam, dtype=jnp.int32)[None, :, None],
                                     (slots, beam, length)),
           'layers': [dict(**chunks, cross_keys=cpu_decoding.carry_keys(cross_slot),
                           cross_values=cross_slot.transpose(cpu_decoding.CARRIED_VALUES))
                      for _ in range(config.num_decoder_layers)]}
  return dict(
      step=jnp.zeros((slots,), jnp.int32),
      tokens=jnp.full((slots, beam), PAD_ID, jnp.int32),
      log_probs=jnp.full((slots, beam), NEG_INF, jnp.float32),
      seqs=jnp.zeros((slots, beam, length), jnp.int32),
      cache=cache,
      fin_seqs=jnp.zeros((slots, nbest, length), jnp.int32),
      fin_scores=jnp.full((slots, nbest), NEG_INF, jnp.float32),
      done=jnp.ones((slots,), bool),
      limits=jnp.ones((slots,), jnp.int32))


def start_slots(state: dict[str, Any], slot: Array, cross: list[tuple[Array, Array]],
                encoder_mask: Array, limits: Array) -> dict[str, Any]:
  """`state` with sentence i started in slot[i] (an index past the slots: none): per decoder
  layer its cross-attention (keys, values) [k, width, heads, head_dim], its encoder_mask
  [k, width] and its length limit [k]."""
  beam = state['tokens'].shape[1]
  init_log_probs = jnp.where(jnp.arange(beam) == 0, 0.0, NEG_INF).astype(jnp.float32)
  put = lambda x, value: x.at[slot].set(value, mode='drop')
  layers = [{**layer,
             'cross_keys': put(layer['cross_keys'], cpu_decoding.carry_keys(keys)),
             'cross_values': put(layer['cross_values'],
                                 values.transpose(cpu_decoding.CARRIED_VALUES))}
            for layer, (keys, values) in zip(state['cache']['layers'], cross)]
  cache = {**state['cache'], 'layers': layers,
           'encoder_mask': put(state['cache']['encoder_mask'], encoder_mask)}
  return {**state, 'cache': cache,
          'step': put(state['step'], 0), 'tokens': put(state['tokens'], PAD_ID),
          'log_probs': put(state['log_probs'], init_log_probs),
          'seqs': put(state['seqs'], 0), 'fin_seqs': put(state['fin_seqs'], 0),
          'fin_scores': put(state['fin_scores'], NEG_INF), 'done': put(state['done'], False),
          'limits': put(state['limits'], limits)}


def step_slots(model: Transformer, variables: Any, state: dict[str, Any], *, alpha: float,
               nbest: int, stopping: str, min_length: int) -> dict[str, Any]:
  """One beam-search step of every slot (`beam_step`); a done slot stays at step 0, so it
  keeps no cache chunk in use."""
  # The CPU step function gives logits; the top-k normalises the blocks it selects.
  select = functools.partial(cpu_decoding.block_top_k_extensions, from_logits=True)
  logits, cache = model.apply(variables, state['tokens'], state['step'], state['cache'],
                              method='decode_step')
  new = beam_step(state, logits, cache, limits=state['limits'],
                  penalty_at_limit=length_penalty(state['limits'], alpha), alpha=alpha,
                  nbest=nbest, stopping=stopping, select=select,
                  reorder=cpu_decoding.reorder_cache, min_length=min_length)
  new['step'] = jnp.where(new['done'], 0, new['step'])
  return new
