"""Beam search, greedy search and sampling for any autoregressive model, jittable end to end.

A model enters through a step function and its cache:

    step_fn(tokens [batch, width] int32, step scalar int32, cache) -> (log_probs, cache)

`tokens` are the tokens at position `step` (0, the start symbol, at step 0), `log_probs`
[batch, width, vocab] float32 the log-softmax of the next token over the whole vocabulary
(padding included in the normaliser), and `cache` any pytree the model carries between steps.
Each search loops (`lax.while_loop`, static shapes) and stops as soon as every sentence is
done. `model/transformer_search.py` runs them on a `Transformer`.

Semantics shared by all searches:
  * An output is a sequence of tokens ending in EOS (1), followed by 0 padding. Its length
    counts the EOS.
  * Sentence i may produce at most `length_limits[i]` tokens (at most `max_length`, the static
    buffer length; for the Transformer, min(source_length_i + max_extra_length, max_length),
    the paper's "input length + 50"); at position `limit_i` EOS is the only choice, so every
    output ends in EOS. Padding (0) is never produced.
  * Scores are sums of the step function's log-probabilities, so a returned score can be
    recomputed with a teacher-forced pass over the returned sequence.
  * `min_length` forbids EOS before that many other tokens (except at the length limit, so
    a sentence whose limit is 1 still ends at once): the Transformer's searches default to 1,
    so a nonempty source never gets an empty translation (as fairseq's and CTranslate2's
    defaults); the generic searches to 0.
  * `force_full_length` (for benchmarks) forbids EOS before `limit_i`, so every step runs.

Optional hooks let a model tune the loop (the Transformer's CPU variant uses them, see
`model/cpu/decoding.py`): `reorder_cache`, `top_k_extensions`, and `chunk_length` with
`grow_cache`.
`beam_step` is one step of the beam search; `model/cpu/continuous_batching.py` runs it with a
position per sentence.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from model.tokens import EOS_ID, PAD_ID

Array = jax.Array
StepFn = Callable[[Array, Array, Any], tuple[Array, Any]]
NEG_INF = -jnp.inf
STOPPING_RULES = ('exact', 'early')


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016); float32."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def gather_beams(x: Array, indices: Array) -> Array:
  """x [batch, beam, ...], indices [batch, n] -> [batch, n, ...]."""
  indices = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, indices, axis=1)


def reorder_every_leaf(cache: Any, parents: Array) -> Any:
  """The default `reorder_cache`: every cache leaf is [batch, beam, ...] and follows `parents`."""
  return jax.tree_util.tree_map(lambda leaf: gather_beams(leaf, parents), cache)


def top_k_extensions(log_probs: Array, hypothesis_log_probs: Array, allowed: Array,
                     k: int) -> tuple[Array, Array]:
  """The k best extensions of all hypotheses of each sentence.

  Args:
    log_probs: [batch, beam, vocab] float32, the next token's log-probabilities.
    hypothesis_log_probs: [batch, beam] float32, -inf for no hypothesis.
    allowed: [batch, 1, vocab] bool, the tokens the rules allow.
    k: how many extensions.
  Returns:
    scores [batch, k] (best first) and flat indices [batch, k] into [beam, vocab].
  """
  scores = hypothesis_log_probs[:, :, None] + jnp.where(allowed, log_probs, NEG_INF)
  return jax.lax.top_k(scores.reshape(scores.shape[0], -1), k)


def _allowed_tokens(vocab: int, step: Array, limits: Array, force_full_length: bool,
                    prefix: Array | None = None, min_length: int = 0) -> Array:
  """[batch, 1, vocab] bool: the tokens the decoding rules allow at position `step` (a
  scalar, or [batch])."""
  ids = jnp.arange(vocab)
  allowed = ids != PAD_ID
  if force_full_length:
    allowed &= ids != EOS_ID
  if min_length:  # Too short to end yet.
    allowed = allowed & ~((ids == EOS_ID) & (jnp.reshape(step, (-1, 1, 1)) < min_length))
  last = (step + 1 >= limits)[:, None, None]  # The last allowed position: EOS only.
  allowed = jnp.where(last, ids == EOS_ID, allowed)
  if prefix is not None:  # Inside a sentence's prefix, its token only.
    forced = jnp.take(prefix, jnp.minimum(step, prefix.shape[1] - 1), axis=1)  # [batch]
    forced = jnp.where(step < prefix.shape[1], forced, PAD_ID)[:, None, None]
    allowed = jnp.where(forced != PAD_ID, ids == forced, allowed)
  return allowed


def check_alpha(alpha: float) -> None:
  """A length-penalty exponent must be finite and >= 0 (the stopping bounds assume it)."""
  if isinstance(alpha, numbers.Real) and not 0 <= alpha < float('inf'):  # False for NaN.
    raise ValueError(f'alpha (the length-penalty exponent) must be a finite number >= 0, '
                     f'got {alpha}.')


def check_min_length(min_length: int) -> None:
  if isinstance(min_length, bool) or not isinstance(min_length, numbers.Integral) or (
      min_length < 0):
    raise ValueError(f'min_length must be an integer >= 0, got {min_length!r}.')


def _limits(length_limits: Array | None, batch_size: int, max_length: int) -> Array:
  if length_limits is None:
    return jnp.full((batch_size,), max_length, jnp.int32)
  return jnp.minimum(jnp.asarray(length_limits, jnp.int32), max_length)


def _set_position(x: Array, step: Array, values: Array) -> Array:
  """x [batch, n, length] with x[:, :, step] = values [batch, n] (step scalar or [batch])."""
  return jnp.where(jnp.arange(x.shape[-1]) == jnp.reshape(step, (-1, 1, 1)),
                   values[:, :, None], x)


def chunk_ends(max_length: int, chunk_length: int) -> list[int]:
  """Where the pieces of a chunked loop end: chunk_length, doubling, then max_length.

  Each piece compiles its own loop body; doubling keeps their number logarithmic in
  max_length, and a cache at most twice the steps decoded so far. A last piece shorter than
  half the one before it joins that one (one loop body fewer to compile, for a few steps
  most batches never reach).
  """
  ends = [min(chunk_length, max_length)]
  while ends[-1] < max_length:
    end = 2 * ends[-1]
    ends.append(max_length if max_length - end < ends[-1] // 2 else end)
  return ends


def _while_loop(cond: Callable, body: Callable, state: dict[str, Any], max_length: int,
                chunk_length: int | None, grow_cache: Callable | None) -> dict[str, Any]:
  """`lax.while_loop(cond, body, state)`, or with `grow_cache` in pieces ending at
  `chunk_ends`: before the piece that ends at step e, grow_cache(cache, e) makes the cache
  hold e steps (the step function then runs on caches of several lengths)."""
  if grow_cache is None:
    return jax.lax.while_loop(cond, body, state)
  for end in chunk_ends(max_length, chunk_length or max_length):
    state = {**state, 'cache': grow_cache(state['cache'], end)}
    state = jax.lax.while_loop(lambda s, end=end: cond(s) & (s['step'] < end), body, state)
  return state


def beam_step(state: dict[str, Any], log_probs: Array, cache: Any, *, limits: Array,
              penalty_at_limit: Array, alpha: float, nbest: int, stopping: str,
              select: Callable[..., tuple[Array, Array]], reorder: Callable[[Any, Array], Any],
              force_full_length: bool = False, prefix: Array | None = None,
              token_log_probs: bool = False, min_length: int = 0) -> dict[str, Any]:
  """One step of `beam_search` once the model has scored it: the next state.

  state['step'] is a scalar, or [batch] (a position per sentence, continuous batching; no
  prefix then). log_probs: [batch, beam, vocab] from the step function, cache its new cache;
  limits, penalty_at_limit [batch]; the rest as `beam_search`.
  """
  step = state['step']
  beam = state['tokens'].shape[1]
  vocab = log_probs.shape[-1]
  allowed = _allowed_tokens(vocab, step, limits, force_full_length, prefix, min_length)
  # The 2 * beam best extensions over all beams: at most `beam` of them are EOS (one per
  # beam), so at least `beam` can stay live.
  cand_log_probs, flat = select(log_probs, state['log_probs'], allowed, 2 * beam)
  parents, tokens = flat // vocab, flat % vocab  # [batch, 2 * beam]
  cand_seqs = _set_position(gather_beams(state['seqs'], parents), step, tokens)
  is_eos = tokens == EOS_ID
  if token_log_probs:  # A candidate's score less its parent's: the new token's.
    gains = cand_log_probs - jnp.take_along_axis(state['log_probs'], parents, axis=1)
    cand_token_lps = _set_position(gather_beams(state['token_lps'], parents), step,
                                   jnp.where(jnp.isfinite(gains), gains, 0.0))

  # Finished: EOS extensions ranked within the best `beam`, merged with the earlier ones.
  newly_finished = is_eos & (jnp.arange(2 * beam) < beam)
  penalty = jnp.reshape(length_penalty(step + 1, alpha), (-1, 1))
  fin_cand = jnp.where(newly_finished, cand_log_probs / penalty, NEG_INF)
  fin_scores, best = jax.lax.top_k(
      jnp.concatenate([state['fin_scores'], fin_cand], axis=1), nbest)
  fin_seqs = gather_beams(jnp.concatenate([state['fin_seqs'], cand_seqs], axis=1), best)
  # Done sentences keep their result while the others go on.
  done = state['done']
  fin_scores = jnp.where(done[:, None], state['fin_scores'], fin_scores)
  fin_seqs = jnp.where(done[:, None, None], state['fin_seqs'], fin_seqs)
  extra = {}
  if token_log_probs:
    fin_token_lps = gather_beams(
        jnp.concatenate([state['fin_token_lps'], cand_token_lps], axis=1), best)
    extra['fin_token_lps'] = jnp.where(done[:, None, None], state['fin_token_lps'],
                                       fin_token_lps)

  # Live: the best `beam` non-EOS extensions.
  alive_log_probs, best = jax.lax.top_k(jnp.where(is_eos, NEG_INF, cand_log_probs), beam)
  parents = jnp.take_along_axis(parents, best, axis=1)  # [batch, beam]
  tokens = jnp.take_along_axis(tokens, best, axis=1)

  penalty_ahead = length_penalty(step + 2, alpha)
  if stopping == 'exact':
    penalty_ahead = jnp.maximum(penalty_at_limit, penalty_ahead)
  bound = alive_log_probs[:, 0] / penalty_ahead
  done = done | (step + 1 >= limits) | (bound <= fin_scores[:, -1])
  if token_log_probs:
    extra['token_lps'] = gather_beams(cand_token_lps, best)
  return {**state, 'step': step + 1, 'tokens': tokens, 'log_probs': alive_log_probs,
          'seqs': gather_beams(cand_seqs, best), 'cache': reorder(cache, parents),
          'fin_seqs': fin_seqs, 'fin_scores': fin_scores, 'done': done, **extra}


def beam_search(step_fn: StepFn, cache: Any, *, batch_size: int, beam_size: int,
                max_length: int, length_limits: Array | None = None, alpha: float = 0.6,
                nbest: int = 1, force_full_length: bool = False, stopping: str = 'exact',
                token_log_probs: bool = False, prefix: Array | None = None,
                reorder_cache: Callable[[Any, Array], Any] | None = None,
                top_k_extensions: Callable[..., tuple[Array, Array]] = top_k_extensions,
                chunk_length: int | None = None,
                grow_cache: Callable[[Any, int], Any] | None = None,
                min_length: int = 0) -> tuple[Array, ...]:
  """Beam search with the GNMT length penalty, finished hypotheses kept apart from live ones.

  A hypothesis' score is sum(log-probs) / length_penalty(length, alpha). Each step takes the
  2 * beam_size best extensions of the live hypotheses: EOS extensions ranked within the best
  beam_size become finished (as in fairseq, so beam_size 1 with alpha 0 is greedy search), the
  best beam_size others stay live. A sentence is done when no live hypothesis can beat its nbest
  finished ones (scores only fall as tokens are added, and the penalty is at most that of its
  length limit), or at its length limit. With a beam wide enough to keep every prefix live the
  search is exhaustive, hence exact. `stopping='early'` bounds the live hypotheses by their
  score if they ended at the next step instead of at the length limit (CTranslate2's rule, which
  stops once the best candidate of a step has finished): the same result for alpha 0, and far
  fewer steps for alpha > 0, where the exact bound keeps a sentence going as long as a longer
  hypothesis could in principle still win through the length penalty.

  Args:
    step_fn: see the module docstring; called with tokens [batch_size, beam_size].
    cache: the model's state for beam_size hypotheses per sentence.
    batch_size: number of sentences.
    beam_size: live hypotheses per sentence.
    max_length: static output length (buffer size).
    length_limits: [batch_size] int, maximum output length per sentence (EOS included);
      None: max_length.
    alpha: length-penalty exponent (0: plain log-probability).
    nbest: number of sequences returned per sentence (<= beam_size).
    force_full_length: forbid EOS before the length limit (benchmarks).
    stopping: 'exact' or 'early' (see above).
    token_log_probs: also return each output token's log-probability.
    prefix: [batch_size, prefix_length] int32, 0-padded: each output starts with its
      sentence's tokens (forced decoding; EOS and 0 are not prefix tokens); the length limit
      leaves room for at least one token after it.
    reorder_cache: reorder_cache(cache, parents [batch, beam]) -> the cache of the hypotheses
      that continue `parents`. Default: every leaf is shaped [batch, beam, ...] and is gathered
      along axis 1.
    top_k_extensions: same signature and results as `top_k_extensions` (the CPU variant:
      `cpu_decoding.block_top_k_extensions`).
    chunk_length, grow_cache: run the loop in pieces; see `_while_loop`.
    min_length: the fewest tokens before EOS (the length limit overrides it).
  Returns:
    sequences [batch, nbest, max_length] int32, best first, each ending in EOS then 0s;
    scores [batch, nbest] float32 (length-penalised), -inf for a missing hypothesis (when a
    sentence has fewer than nbest possible outputs); with `token_log_probs`, also
    [batch, nbest, max_length] float32, each token's log-probability (0 after the EOS), which
    sum to the unpenalised score.
  """
  if not 1 <= nbest <= beam_size:
    raise ValueError(f'need 1 <= nbest <= beam_size, got nbest={nbest}, beam_size={beam_size}.')
  if stopping not in STOPPING_RULES:
    raise ValueError(f'stopping must be one of {STOPPING_RULES}, got {stopping!r}.')
  check_min_length(min_length)
  check_alpha(alpha)
  batch, beam, length = batch_size, beam_size, max_length
  limits = _limits(length_limits, batch, length)
  if prefix is not None:
    prefix = jnp.asarray(prefix, jnp.int32)
    prefix_lengths = jnp.sum(prefix != PAD_ID, axis=1, dtype=jnp.int32)
    limits = jnp.minimum(jnp.maximum(limits, prefix_lengths + 1), length)
  reorder = reorder_cache or reorder_every_leaf
  select = top_k_extensions
  # Sentence i's penalty at its limit: the largest ahead for alpha >= 0 (see `bound`).
  penalty_at_limit = length_penalty(limits, alpha)

  def cond(state):
    return (state['step'] < length) & ~jnp.all(state['done'])

  def body(state):
    log_probs, cache = step_fn(state['tokens'], state['step'], state['cache'])
    return beam_step(state, log_probs, cache, limits=limits, penalty_at_limit=penalty_at_limit,
                     alpha=alpha, nbest=nbest, stopping=stopping, select=select,
                     reorder=reorder, force_full_length=force_full_length, prefix=prefix,
                     token_log_probs=token_log_probs, min_length=min_length)

  # Step 0: all beams hold the same empty prefix; only beam 0 may extend it.
  init_log_probs = jnp.where(jnp.arange(beam) == 0, 0.0, NEG_INF)
  state = dict(
      step=jnp.array(0, jnp.int32),
      tokens=jnp.full((batch, beam), PAD_ID, jnp.int32),
      log_probs=jnp.broadcast_to(init_log_probs, (batch, beam)).astype(jnp.float32),
      seqs=jnp.zeros((batch, beam, length), jnp.int32),
      cache=cache,
      fin_seqs=jnp.zeros((batch, nbest, length), jnp.int32),
      fin_scores=jnp.full((batch, nbest), NEG_INF, jnp.float32),
      done=jnp.zeros((batch,), bool))
  if token_log_probs:
    state.update(token_lps=jnp.zeros((batch, beam, length), jnp.float32),
                 fin_token_lps=jnp.zeros((batch, nbest, length), jnp.float32))
  state = _while_loop(cond, body, state, length, chunk_length, grow_cache)
  if token_log_probs:
    return state['fin_seqs'], state['fin_scores'], state['fin_token_lps']
  return state['fin_seqs'], state['fin_scores']


def _sample_loop(step_fn: StepFn, cache: Any, choose: Callable[[Array, Array], Array],
                 batch_size: int, width: int, max_length: int, length_limits: Array | None,
                 force_full_length: bool, chunk_length: int | None,
                 grow_cache: Callable | None, min_length: int) -> tuple[Array, Array]:
  """Left-to-right decoding of `width` independent hypotheses per sentence.

  `choose(log_probs [batch, width, vocab], step) -> tokens [batch, width]` picks each token.
  Returns sequences [batch, width, max_length] int32 (EOS then 0s) and their summed
  log-probabilities [batch, width] float32.
  """
  check_min_length(min_length)
  limits = _limits(length_limits, batch_size, max_length)

  def cond(state):
    return (state['step'] < max_length) & ~jnp.all(state['finished'])

  def body(state):
    step, finished = state['step'], state['finished']
    log_probs, cache = step_fn(state['tokens'], step, state['cache'])
    allowed = _allowed_tokens(log_probs.shape[-1], step, limits, force_full_length,
                              min_length=min_length)
    log_probs = jnp.where(allowed, log_probs, NEG_INF)
    tokens = jnp.where(finished, PAD_ID, choose(log_probs, step))
    gain = jnp.take_along_axis(log_probs, tokens[:, :, None], axis=-1)[:, :, 0]
    return dict(step=step + 1, tokens=tokens, cache=cache,
                seqs=_set_position(state['seqs'], step, tokens),
                log_probs=state['log_probs'] + jnp.where(finished, 0.0, gain),
                finished=finished | (tokens == EOS_ID))

  state = dict(
      step=jnp.array(0, jnp.int32),
      tokens=jnp.full((batch_size, width), PAD_ID, jnp.int32),
      cache=cache,
      seqs=jnp.zeros((batch_size, width, max_length), jnp.int32),
      log_probs=jnp.zeros((batch_size, width), jnp.float32),
      finished=jnp.zeros((batch_size, width), bool))
  state = _while_loop(cond, body, state, max_length, chunk_length, grow_cache)
  return state['seqs'], state['log_probs']


def greedy_search(step_fn: StepFn, cache: Any, *, batch_size: int, max_length: int,
                  length_limits: Array | None = None, force_full_length: bool = False,
                  chunk_length: int | None = None,
                  grow_cache: Callable[[Any, int], Any] | None = None,
                  min_length: int = 0) -> tuple[Array, Array]:
  """The most probable token at every step; step_fn sees tokens [batch_size, 1].

  Args: as `beam_search`.
  Returns:
    sequences [batch, max_length] int32 ending in EOS then 0s; their summed
    log-probabilities [batch] float32 (no length penalty).
  """
  seqs, log_probs = _sample_loop(
      step_fn, cache, lambda log_probs, step: jnp.argmax(log_probs, axis=-1), batch_size, 1,
      max_length, length_limits, force_full_length, chunk_length, grow_cache, min_length)
  return seqs[:, 0], log_probs[:, 0]


def sample(step_fn: StepFn, cache: Any, rng: Array, *, batch_size: int, max_length: int,
           num_samples: int = 1, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           length_limits: Array | None = None, force_full_length: bool = False,
           chunk_length: int | None = None,
           grow_cache: Callable[[Any, int], Any] | None = None,
           min_length: int = 0) -> tuple[Array, Array]:
  """Ancestral sampling from the temperature-scaled, top-k / nucleus-truncated distribution.

  Args:
    step_fn, cache: as `beam_search`, for num_samples hypotheses per sentence.
    rng: a PRNG key; the same key gives the same samples.
    num_samples: independent samples per sentence.
    temperature: > 0; the log-probabilities are divided by it.
    top_k: sample among the k most probable tokens only (0: all).
    top_p: sample among the smallest set of most probable tokens whose probability reaches
      top_p (nucleus sampling; 1: all). The most probable token is always kept.
    Others as `beam_search`.
  Returns:
    sequences [batch, num_samples, max_length] int32 ending in EOS then 0s; their summed
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

  return _sample_loop(step_fn, cache, choose, batch_size, num_samples, max_length,
                      length_limits, force_full_length, chunk_length, grow_cache, min_length)
