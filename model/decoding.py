"""Beam search, greedy search and sampling for `Transformer`, jittable end to end.

All three loop (`lax.while_loop`, static shapes) over `Transformer.decode_step`. The source is
encoded, and its cross-attention keys/values projected, once per sentence; each step feeds only
the newest token of every hypothesis through the decoder cache, which beam search never
reorders; the loop stops as soon as every sentence is done. The loop runs in chunks whose
self-attention cache covers only the steps so far (`cache_chunk`).

Semantics shared by all searches:
  * An output is a sequence of tokens ending in EOS (1), followed by 0 padding. Its length
    counts the EOS.
  * Sentence i may produce at most `limit_i = min(source_length_i + max_extra_length,
    max_decode_len)` tokens (the paper's "input length + 50"); at position `limit_i` EOS is the
    only choice, so every output ends in EOS. Padding (0) is never produced.
  * Log-probabilities are the model's log-softmax over the whole vocabulary (padding included
    in the normaliser, then forbidden), so a returned score can be recomputed with a
    teacher-forced `Transformer.__call__` on the returned sequence.
  * `force_full_length` (for benchmarks) forbids EOS before `limit_i`, so every step runs.

Jit with the model and the static settings bound, e.g.
`jax.jit(functools.partial(beam_search, model, beam_size=4))(params, inputs)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from model.transformer import EOS_ID, PAD_ID, Transformer

Array = jax.Array
NEG_INF = -jnp.inf


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016); float32."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _buffer_length(model: Transformer, inputs: Array, max_decode_len: int | None,
                   max_extra_length: int) -> int:
  """Static output buffer length: max_decode_len, or source width + max_extra_length capped
  by the model's maximum length."""
  if max_decode_len is None:
    max_decode_len = min(inputs.shape[1] + max_extra_length, model.config.max_len)
  return max_decode_len


def _length_limits(inputs: Array, max_decode_len: int, max_extra_length: int) -> Array:
  """Per sentence maximum output length (EOS included): [batch] int32."""
  source_lengths = jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32)
  return jnp.minimum(source_lengths + max_extra_length, max_decode_len)


# The loops carry the cross-attention keys/values as [batch, heads, head_dim, src_len], the
# layout XLA's attention dot product wants: the transpose back in `_decode_step` cancels against
# the one XLA inserts inside decode_step, instead of copying them at every step.
_CARRIED = (0, 2, 3, 1)  # [batch, src_len, heads, head_dim] -> carried.
_UNCARRIED = (0, 3, 1, 2)  # And back.
_CROSS = ('cross_keys', 'cross_values')


def _transpose_cross(cache: dict[str, Any], axes: tuple[int, ...]) -> dict[str, Any]:
  """The cache with every layer's cross-attention keys/values transposed by `axes`."""
  layers = [{k: jnp.transpose(v, axes) if k in _CROSS else v for k, v in layer.items()}
            for layer in cache['layers']]
  return {**cache, 'layers': layers}


def _start(model: Transformer, params: Any, inputs: Array, width: int,
           max_decode_len: int) -> dict[str, Any]:
  """Encodes the source and builds the (carried) cache for `width` hypotheses per sentence."""
  variables = {'params': params}
  encoded = model.apply(variables, inputs, method='encode')
  cache = model.apply(variables, encoded, inputs, width, max_decode_len,
                      method='init_decode_cache')
  # The barrier stops XLA from sinking the transpose back into the loop body.
  return jax.lax.optimization_barrier(_transpose_cross(cache, _CARRIED))


def _decode_step(model: Transformer, params: Any, tokens: Array, step: Array,
                 cache: dict[str, Any], slots: Array | None) -> tuple[Array, dict[str, Any]]:
  """`Transformer.decode_step` on the carried cache: logits [batch, width, vocab], cache."""
  logits, new_cache = model.apply({'params': params}, tokens, step,
                                  _transpose_cross(cache, _UNCARRIED), slots,
                                  method='decode_step')
  layers = [{**new, **{k: old[k] for k in _CROSS}}
            for new, old in zip(new_cache['layers'], cache['layers'])]
  return logits, {**new_cache, 'layers': layers}


def _chunk_ends(length: int, chunk: int | None) -> list[int]:
  """Static cache lengths of the successive decoding loops: chunk, 2 * chunk, ..., length."""
  if not chunk or chunk >= length:
    return [length]
  return list(range(chunk, length, chunk)) + [length]


def _grow_cache(cache: dict[str, Any], length: int, width: int) -> dict[str, Any]:
  """Pads the self-attention cache ([batch, heads, head_dim, len * width]) to `length` steps."""
  def grow(layer):
    pad = lambda t: jnp.pad(t, [(0, 0)] * 3 + [(0, length * width - t.shape[3])])
    return {**layer, 'self_keys': pad(layer['self_keys']),
            'self_values': pad(layer['self_values'])}
  return {**cache, 'layers': [grow(layer) for layer in cache['layers']]}


def _chunked_while_loop(cond: Callable, body_for: Callable, state: dict[str, Any],
                        ends: list[int]) -> dict[str, Any]:
  """`lax.while_loop(cond, body, state)` in pieces whose cache holds just the steps so far.

  Step t attends over the cache's whole (masked) length, so the loop for steps
  [ends[i-1], ends[i]) runs on a cache of ends[i] steps, grown between loops: early steps
  skip most of the attention work. `body_for(length)` is the body for a cache of `length`.
  """
  width = state['tokens'].shape[1]
  for end in ends:
    state = {**state, 'cache': _grow_cache(state['cache'], end, width)}
    state = jax.lax.while_loop(lambda s: cond(s) & (s['step'] < end), body_for(end), state)
  return state


def _allowed_tokens(vocab: int, step: Array, limits: Array, force_full_length: bool) -> Array:
  """[batch, 1, vocab] bool: the tokens the decoding rules allow at position `step`."""
  ids = jnp.arange(vocab)
  allowed = ids != PAD_ID
  if force_full_length:
    allowed &= ids != EOS_ID
  last = (step + 1 >= limits)[:, None, None]  # The last allowed position: EOS only.
  return jnp.where(last, ids == EOS_ID, allowed)


def _next_log_probs(logits: Array, step: Array, limits: Array,
                    force_full_length: bool) -> Array:
  """Log-probabilities of the next token with the decoding rules applied (forbidden: -inf).

  Args:
    logits: [batch, width, vocab] float32 for the token at position `step`.
    step: scalar int, 0-based output position being chosen.
    limits: [batch] int, maximum output length per sentence.
  Returns:
    [batch, width, vocab] float32.
  """
  allowed = _allowed_tokens(logits.shape[-1], step, limits, force_full_length)
  return jnp.where(allowed, jax.nn.log_softmax(logits, axis=-1), NEG_INF)


_BLOCK = 128  # `_best_extensions` block when no divisor of the vocabulary fits.


def _block_size(vocab: int) -> int:
  """The largest divisor of `vocab` in [64, 256] (blocks then need no padding copy), or _BLOCK."""
  return next((b for b in range(256, 63, -1) if vocab % b == 0), _BLOCK)


def _best_extensions(logits: Array, hypothesis_log_probs: Array, step: Array, limits: Array,
                     force_full_length: bool, k: int) -> tuple[Array, Array]:
  """`lax.top_k` of every extension's score, without scoring or sorting every extension.

  Equal, ties and all, to `top_k((hypothesis_log_probs[..., None] + _next_log_probs(logits,
  ...)).reshape(batch, -1), k)`. XLA:CPU's top_k over 4 x 8000 scores per sentence took 1.1 ms
  of a 10 ms beam-search step, and scoring them another 0.7 ms. Instead: the maximum of each
  vocabulary block of each hypothesis (one cheap reduction); the k best blocks by the score of
  their maximum, which hold the k best extensions (a block holding one of them has a maximum
  that fewer than k extensions beat, each in its own block); top_k over those k blocks only.
  A score rounds monotonically in its logit, so a block's best score is its maximum's score.

  Args:
    logits: [batch, beam, vocab] float32.
    hypothesis_log_probs: [batch, beam] float32, -inf for no hypothesis.
    step, limits, force_full_length: as for `_next_log_probs`.
    k: how many extensions.
  Returns:
    scores [batch, k] (best first) and flat indices [batch, k] into [beam, vocab].
  """
  batch, beam, vocab = logits.shape
  size = _block_size(vocab)
  if k * size >= beam * vocab:  # Small vocabularies: the blocks would be all of it.
    scores = hypothesis_log_probs[:, :, None] + _next_log_probs(logits, step, limits,
                                                                 force_full_length)
    return jax.lax.top_k(scores.reshape(batch, beam * vocab), k)
  blocks = -(-vocab // size)
  allowed = _allowed_tokens(vocab, step, limits, force_full_length)  # [batch, 1, vocab]
  masked = jnp.where(allowed, logits, NEG_INF)
  if blocks * size > vocab:  # Costs a copy of the logits: only when no divisor fits.
    masked = jnp.pad(masked, [(0, 0), (0, 0), (0, blocks * size - vocab)],
                     constant_values=NEG_INF)
  masked = masked.reshape(batch, beam * blocks, size)
  # jax.nn.log_softmax's own arithmetic, so selected scores are bit-identical to it.
  row_max = jnp.max(logits, axis=-1)  # [batch, beam]
  shifted_log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1))

  def score(x: Array, rows: Array) -> Array:  # x [batch, n, ...] of hypotheses rows [batch, n].
    take = lambda t: jnp.take_along_axis(t, rows, axis=1).reshape(
        rows.shape + (1,) * (x.ndim - 2))
    return take(hypothesis_log_probs) + ((x - take(row_max)) - take(shifted_log_sum))

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


def _gather_beams(x: Array, indices: Array) -> Array:
  """x [batch, beam, ...], indices [batch, n] -> [batch, n, ...]."""
  indices = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, indices, axis=1)


def _set_position(x: Array, step: Array, values: Array) -> Array:
  """x [batch, n, length] with x[:, :, step] = values [batch, n]."""
  return jnp.where(jnp.arange(x.shape[-1]) == step, values[:, :, None], x)


def beam_search(model: Transformer, params: Any, inputs: Array, *, beam_size: int = 4,
                alpha: float = 0.6, max_decode_len: int | None = None,
                max_extra_length: int = 50, nbest: int = 1, force_full_length: bool = False,
                cache_chunk: int | None = 8) -> tuple[Array, Array]:
  """Beam search with the GNMT length penalty, finished hypotheses kept apart from live ones.

  A hypothesis' score is sum(log-probs) / length_penalty(length, alpha). Each step takes the
  2 * beam_size best extensions of the live hypotheses: EOS extensions ranked within the best
  beam_size become finished (as in fairseq, so beam_size 1 with alpha 0 is greedy search), the
  best beam_size others stay live. A sentence is done when no live hypothesis can beat its nbest
  finished ones (scores only fall as tokens are added, and the penalty is at most that of its
  length limit), or at its length limit. With a beam wide enough to keep every prefix live the
  search is exhaustive, hence exact.

  The cache is never reordered: decode_step reads each hypothesis' ancestry through
  `cache_slots`, a [batch, beam, max_decode_len] int array that is reordered instead.

  Args:
    model: the `Transformer` module.
    params: its parameters.
    inputs: [batch, src_len] int source ids, 0-padded.
    beam_size: live hypotheses per sentence.
    alpha: length-penalty exponent (0: plain log-probability).
    max_decode_len: static output length (buffer size); default min(src_len +
      max_extra_length, config.max_len).
    max_extra_length: per sentence, at most source length + this many output tokens.
    nbest: number of sequences returned per sentence (<= beam_size).
    force_full_length: forbid EOS before the length limit (benchmarks).
    cache_chunk: grow the self-attention cache by this many steps at a time, so attention
      covers the steps so far (rounded up) rather than the whole buffer; None: one loop.
      Each chunk compiles its own loop body.
  Returns:
    sequences [batch, nbest, max_decode_len] int32, best first, each ending in EOS then 0s;
    scores [batch, nbest] float32 (length-penalised), -inf for a missing hypothesis (when a
    sentence has fewer than nbest possible outputs).
  """
  if not 1 <= nbest <= beam_size:
    raise ValueError(f'need 1 <= nbest <= beam_size, got nbest={nbest}, beam_size={beam_size}.')
  inputs = jnp.asarray(inputs)
  batch, beam = inputs.shape[0], beam_size
  length = _buffer_length(model, inputs, max_decode_len, max_extra_length)
  limits = _length_limits(inputs, length, max_extra_length)
  # Sentence i's penalty at its limit: the largest ahead for alpha >= 0 (see `bound`).
  penalty_at_limit = length_penalty(limits, alpha)
  ends = _chunk_ends(length, cache_chunk)

  def cond(state):
    return (state['step'] < length) & ~jnp.all(state['done'])

  def body_for(view):  # The body for a cache of `view` steps.
    return lambda state: body(state, view)

  def body(state, view):
    step = state['step']
    logits, cache = _decode_step(model, params, state['tokens'], step, state['cache'],
                                 state['slots'][:, :, :view])
    vocab = logits.shape[-1]
    # The 2 * beam best extensions over all beams: at most `beam` of them are EOS (one per
    # beam), so at least `beam` can stay live.
    cand_log_probs, flat = _best_extensions(logits, state['log_probs'], step, limits,
                                            force_full_length, 2 * beam)
    parents, tokens = flat // vocab, flat % vocab  # [batch, 2 * beam]
    cand_seqs = _set_position(_gather_beams(state['seqs'], parents), step, tokens)
    is_eos = tokens == EOS_ID

    # Finished: EOS extensions ranked within the best `beam`, merged with the earlier ones.
    newly_finished = is_eos & (jnp.arange(2 * beam) < beam)
    fin_cand = jnp.where(newly_finished, cand_log_probs / length_penalty(step + 1, alpha),
                         NEG_INF)
    fin_scores, best = jax.lax.top_k(
        jnp.concatenate([state['fin_scores'], fin_cand], axis=1), nbest)
    fin_seqs = _gather_beams(jnp.concatenate([state['fin_seqs'], cand_seqs], axis=1), best)
    # Done sentences keep their result while the others go on.
    done = state['done']
    fin_scores = jnp.where(done[:, None], state['fin_scores'], fin_scores)
    fin_seqs = jnp.where(done[:, None, None], state['fin_seqs'], fin_seqs)

    # Live: the best `beam` non-EOS extensions.
    alive_log_probs, best = jax.lax.top_k(jnp.where(is_eos, NEG_INF, cand_log_probs), beam)
    parents = jnp.take_along_axis(parents, best, axis=1)  # [batch, beam]
    tokens = jnp.take_along_axis(tokens, best, axis=1)
    # A child's ancestor at `step` is its parent's entry, written in the parent's slot.
    slots = _set_position(_gather_beams(state['slots'], parents), step, parents)

    bound = alive_log_probs[:, 0] / jnp.maximum(penalty_at_limit,
                                                length_penalty(step + 2, alpha))
    done = done | (step + 1 >= limits) | (bound <= fin_scores[:, -1])
    return dict(step=step + 1, tokens=tokens, log_probs=alive_log_probs,
                seqs=_gather_beams(cand_seqs, best), slots=slots, cache=cache,
                fin_seqs=fin_seqs, fin_scores=fin_scores, done=done)

  # Step 0: all beams hold the same empty prefix; only beam 0 may extend it.
  init_log_probs = jnp.where(jnp.arange(beam) == 0, 0.0, NEG_INF)
  state = dict(
      step=jnp.array(0, jnp.int32),
      tokens=jnp.full((batch, beam), PAD_ID, jnp.int32),
      log_probs=jnp.broadcast_to(init_log_probs, (batch, beam)).astype(jnp.float32),
      seqs=jnp.zeros((batch, beam, length), jnp.int32),
      slots=jnp.zeros((batch, beam, length), jnp.int32),
      cache=_start(model, params, inputs, beam, ends[0]),
      fin_seqs=jnp.zeros((batch, nbest, length), jnp.int32),
      fin_scores=jnp.full((batch, nbest), NEG_INF, jnp.float32),
      done=jnp.zeros((batch,), bool))
  state = _chunked_while_loop(cond, body_for, state, ends)
  return state['fin_seqs'], state['fin_scores']


def _sample_loop(model: Transformer, params: Any, inputs: Array,
                 choose: Callable[[Array, Array], Array], width: int,
                 max_decode_len: int | None, max_extra_length: int,
                 force_full_length: bool, cache_chunk: int | None) -> tuple[Array, Array]:
  """Left-to-right decoding of `width` independent hypotheses per sentence.

  `choose(log_probs [batch, width, vocab], step) -> tokens [batch, width]` picks each token.
  Returns sequences [batch, width, max_decode_len] int32 (EOS then 0s) and their summed model
  log-probabilities [batch, width] float32.
  """
  inputs = jnp.asarray(inputs)
  batch = inputs.shape[0]
  length = _buffer_length(model, inputs, max_decode_len, max_extra_length)
  limits = _length_limits(inputs, length, max_extra_length)
  ends = _chunk_ends(length, cache_chunk)

  def cond(state):
    return (state['step'] < length) & ~jnp.all(state['finished'])

  def body(state):  # Works for any cache length.
    step, finished = state['step'], state['finished']
    logits, cache = _decode_step(model, params, state['tokens'], step, state['cache'], None)
    log_probs = _next_log_probs(logits, step, limits, force_full_length)
    tokens = jnp.where(finished, PAD_ID, choose(log_probs, step))
    gain = jnp.take_along_axis(log_probs, tokens[:, :, None], axis=-1)[:, :, 0]
    return dict(step=step + 1, tokens=tokens, cache=cache,
                seqs=_set_position(state['seqs'], step, tokens),
                log_probs=state['log_probs'] + jnp.where(finished, 0.0, gain),
                finished=finished | (tokens == EOS_ID))

  state = dict(
      step=jnp.array(0, jnp.int32),
      tokens=jnp.full((batch, width), PAD_ID, jnp.int32),
      cache=_start(model, params, inputs, width, ends[0]),
      seqs=jnp.zeros((batch, width, length), jnp.int32),
      log_probs=jnp.zeros((batch, width), jnp.float32),
      finished=jnp.zeros((batch, width), bool))
  state = _chunked_while_loop(cond, lambda view: body, state, ends)
  return state['seqs'], state['log_probs']


def greedy_search(model: Transformer, params: Any, inputs: Array, *,
                  max_decode_len: int | None = None, max_extra_length: int = 50,
                  force_full_length: bool = False,
                  cache_chunk: int | None = 8) -> tuple[Array, Array]:
  """The most probable token at every step.

  Args: as `beam_search`.
  Returns:
    sequences [batch, max_decode_len] int32 ending in EOS then 0s; their summed
    log-probabilities [batch] float32 (no length penalty).
  """
  seqs, log_probs = _sample_loop(
      model, params, inputs, lambda log_probs, step: jnp.argmax(log_probs, axis=-1), 1,
      max_decode_len, max_extra_length, force_full_length, cache_chunk)
  return seqs[:, 0], log_probs[:, 0]


def sample(model: Transformer, params: Any, inputs: Array, rng: Array, *,
           num_samples: int = 1, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           max_decode_len: int | None = None, max_extra_length: int = 50,
           force_full_length: bool = False, cache_chunk: int | None = 8) -> tuple[Array, Array]:
  """Ancestral sampling from the temperature-scaled, top-k / nucleus-truncated distribution.

  Args:
    rng: a PRNG key; the same key gives the same samples.
    num_samples: independent samples per sentence.
    temperature: > 0; the logits are divided by it.
    top_k: sample among the k most probable tokens only (0: all).
    top_p: sample among the smallest set of most probable tokens whose probability reaches
      top_p (nucleus sampling; 1: all). The most probable token is always kept.
    Others as `beam_search`.
  Returns:
    sequences [batch, num_samples, max_decode_len] int32 ending in EOS then 0s; their summed
    log-probabilities under the model (untempered, untruncated) [batch, num_samples] float32.
  """
  if temperature <= 0:
    raise ValueError(f'temperature must be > 0, got {temperature}; use greedy_search instead.')

  def choose(log_probs, step):
    logits = log_probs / temperature
    if top_k:
      kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
      logits = jnp.where(logits >= kth, logits, NEG_INF)
    if top_p < 1.0:
      # Keep tokens whose preceding (more probable) mass is below top_p.
      ordered = jnp.sort(logits, axis=-1)[..., ::-1]
      probs = jax.nn.softmax(ordered, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs
      count = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
      threshold = jnp.take_along_axis(ordered, count - 1, axis=-1)
      logits = jnp.where(logits >= threshold, logits, NEG_INF)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)

  return _sample_loop(model, params, inputs, choose, num_samples, max_decode_len,
                      max_extra_length, force_full_length, cache_chunk)
