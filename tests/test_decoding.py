"""Tests of model/search.py: beam search against brute force, greedy search and sampling,
batch invariance, and cached scores against the teacher-forced forward pass."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import (
  EOS_ID,
  Transformer,
  TransformerConfig,
  beam_search,
  greedy_search,
  length_penalty,
  search,
  transformer_beam_search,
  transformer_greedy_search,
  transformer_sample,
)
from model.cpu import continuous_batching
from model.cpu import decoding as cpu_decoding

ALPHA = 0.6


def make_model(vocab: int, seed: int = 0, scale: float = 2.0, eos_bias: float = -3.0,
               cpu_tuned: bool | None = None, **overrides):
  """A small random model whose outputs depend on the source and end at varied lengths.

  All kernels and embeddings are scaled up (peakier distributions), and the last decoder
  LayerNorm's bias gets a component along the EOS embedding orthogonal to every other
  embedding, which adds exactly `eos_bias` to the EOS logit (there is no output bias).
  """
  config = TransformerConfig(vocab_size=vocab, d_model=32, num_heads=4, d_ff=64,
                             num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                             max_len=64, cpu_tuned=cpu_tuned, **overrides)
  model = Transformer(config)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(seed), dummy, dummy)['params']
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * scale if 'kernel' in str(path) or 'embedding' in str(path) else x,
      params)
  table = np.asarray(params['embed']['embedding'], np.float64)
  basis, _ = np.linalg.qr(np.delete(table, EOS_ID, axis=0).T)
  direction = table[EOS_ID] - basis @ (basis.T @ table[EOS_ID])
  norm = params['decoder']['layers_1']['feed_forward_sublayer']['norm']
  norm['bias'] = jnp.asarray(direction * eos_bias / (direction @ direction), jnp.float32)
  return model, params


def random_sources(rng, lengths, vocab, width=None):
  """[len(lengths), width] real ids in [3, vocab), 0-padded after each length."""
  width = width or max(lengths)
  tokens = rng.integers(3, vocab, size=(len(lengths), width)).astype(np.int32)
  return np.where(np.arange(width) < np.array(lengths)[:, None], tokens, 0)


def output_lengths(seqs) -> np.ndarray:
  """Number of tokens up to and including the first EOS."""
  return np.argmax(np.asarray(seqs) == EOS_ID, axis=-1) + 1


@functools.cache
def jitted(fn, model, **settings):
  """One compiled function per (function, model, static settings)."""
  return jax.jit(functools.partial(fn, model, **settings))


def forward_logits(model, params, inputs, targets):
  return jitted(Transformer.apply, model)({'params': params}, inputs, targets)


def forward_log_probs(model, params, inputs, targets) -> np.ndarray:
  """Teacher-forced sum of log-softmax of `targets` [n, length] (0s ignored): [n]."""
  logits = forward_logits(model, params, jnp.asarray(inputs), jnp.asarray(targets))
  log_probs = np.asarray(jax.nn.log_softmax(logits), np.float64)
  picked = np.take_along_axis(log_probs, np.asarray(targets)[..., None], axis=-1)[..., 0]
  return np.where(np.asarray(targets) > 0, picked, 0.0).sum(-1)


def check_well_formed(seqs):
  """Every sequence: real tokens, one EOS, then only padding."""
  seqs = np.asarray(seqs).reshape(-1, np.shape(seqs)[-1])
  lengths = output_lengths(seqs)
  positions = np.arange(seqs.shape[1])
  assert np.all(seqs[np.arange(len(seqs)), lengths - 1] == EOS_ID)
  assert np.all((seqs > EOS_ID) == (positions < lengths[:, None] - 1))
  assert np.all((seqs == 0) == (positions >= lengths[:, None]))


@pytest.fixture(scope='module')
def medium():
  """vocab 20, a batch of 6 sources of different lengths; outputs end at varied lengths."""
  model, params = make_model(20, seed=1, scale=1.0, eos_bias=1.5)
  inputs = random_sources(np.random.default_rng(1), [7, 3, 5, 1, 6, 4], 20)
  return model, params, inputs


# --------------------------------------------------------------------------------------------
# Beam search.


def test_beam_search_is_exact_with_an_exhaustive_beam():
  """Vocab 5 (3 non-EOS tokens), <= 4 output tokens: a beam of 36 keeps every prefix live,
  so the 3 best outputs must be the 3 best of all sequences ending in EOS within each
  sentence's limit (min(source length + 1, 4) here), under the same length penalty, with
  at least one token before the EOS (the Transformer searches' min_length 1)."""
  vocab, max_len, nbest = 5, 4, 3
  model, params = make_model(vocab, seed=4)
  source_lengths = [6, 6, 6, 6, 2, 3, 1, 6]
  inputs = random_sources(np.random.default_rng(0), source_lengths, vocab)
  seqs, scores = map(np.asarray, jitted(
      transformer_beam_search, model, beam_size=36, alpha=ALPHA, max_length=max_len,
      max_extra_length=1, nbest=nbest)(params, inputs))
  check_well_formed(seqs)

  candidates = np.array([list(prefix) + [EOS_ID] + [0] * (max_len - n)
                         for n in range(2, max_len + 1)
                         for prefix in itertools.product(range(2, vocab), repeat=n - 1)])
  lengths = output_lengths(candidates)
  best_lengths = []
  for i, source_length in enumerate(source_lengths):
    allowed = candidates[lengths <= min(source_length + 1, max_len)]
    log_probs = forward_log_probs(model, params, np.repeat(inputs[i:i + 1], len(allowed), 0),
                                  allowed)
    brute = log_probs / np.asarray(length_penalty(output_lengths(allowed), ALPHA))
    order = np.argsort(-brute, kind='stable')[:nbest]
    np.testing.assert_array_equal(seqs[i], allowed[order])
    np.testing.assert_allclose(scores[i], brute[order], rtol=1e-5, atol=1e-5)
    best_lengths.append(output_lengths(allowed[order[0]]))
  # The test is only meaningful if hypotheses of different lengths compete.
  assert len(set(best_lengths)) >= 3, best_lengths


def test_beam_size_one_is_greedy_search(medium):
  """With alpha 0 the finished EOS hypothesis of beam 1 always beats its live rival."""
  model, params, inputs = medium
  beam_seqs, beam_scores = jitted(transformer_beam_search, model, beam_size=1, alpha=0.0,
                                  max_length=16)(params, inputs)
  greedy_seqs, greedy_scores = jitted(transformer_greedy_search, model, max_length=16)(
      params, inputs)
  np.testing.assert_array_equal(beam_seqs[:, 0], greedy_seqs)
  np.testing.assert_allclose(beam_scores[:, 0], greedy_scores, rtol=1e-5)
  assert len(set(output_lengths(greedy_seqs))) > 1  # EOS at varied steps.


def test_scores_match_the_forward_pass_and_nbest_is_sorted(medium):
  model, params, inputs = medium
  nbest, max_len = 4, 16
  seqs, scores = map(np.asarray, jitted(
      transformer_beam_search, model, beam_size=4, alpha=ALPHA, max_length=max_len, nbest=nbest)(
          params, inputs))
  assert seqs.shape == (len(inputs), nbest, max_len) and scores.shape == (len(inputs), nbest)
  check_well_formed(seqs)
  assert np.all(np.diff(scores, axis=1) <= 0)
  assert all(len({tuple(s) for s in sentence}) == nbest for sentence in seqs)
  flat = seqs.reshape(-1, max_len)
  full = forward_log_probs(model, params, np.repeat(inputs, nbest, 0), flat)
  penalty = np.asarray(length_penalty(output_lengths(flat), ALPHA))
  np.testing.assert_allclose(scores.reshape(-1) * penalty, full, rtol=1e-4, atol=1e-4)


def test_sentence_alone_equals_sentence_in_a_batch(medium):
  """Also across the variants: alone, the other `cpu_tuned` setting (another cache layout and
  reordering, one loop instead of chunks, plain top_k)."""
  model, params, inputs = medium
  other = Transformer(dataclasses.replace(model.config,
                                          cpu_tuned=not model.config.use_cpu_tuned))
  settings = dict(beam_size=4, alpha=ALPHA, max_length=16, nbest=2)
  batch_seqs, batch_scores = jitted(transformer_beam_search, model, **settings)(params, inputs)
  for i in [1, 3]:
    alone = inputs[i:i + 1, :max(1, int(np.sum(inputs[i] > 0)))]  # Its own padding width.
    seqs, scores = jitted(transformer_beam_search, other, **settings)(params, alone)
    np.testing.assert_array_equal(seqs[0], batch_seqs[i])
    np.testing.assert_allclose(scores[0], batch_scores[i], rtol=1e-5, atol=1e-5)


def test_length_limits_and_force_full_length(medium):
  model, params, inputs = medium
  limits = np.sum(inputs > 0, axis=1) + 2
  for force in [False, True]:
    seqs, scores = jitted(transformer_beam_search, model, beam_size=3, alpha=ALPHA,
                          max_extra_length=2, nbest=3, force_full_length=force)(params, inputs)
    # The default buffer is source width + max_extra_length (capped by config.max_len).
    assert seqs.shape[-1] == inputs.shape[1] + 2
    check_well_formed(seqs)
    lengths = output_lengths(seqs)
    assert np.all(lengths <= limits[:, None])
    if force:
      assert np.all(lengths == limits[:, None])
    else:
      assert np.any(lengths < limits[:, None])


# --------------------------------------------------------------------------------------------
# Greedy search and sampling.


def test_greedy_log_probs_match_the_forward_pass(medium):
  model, params, inputs = medium
  seqs, log_probs = jitted(transformer_greedy_search, model, max_length=16)(params, inputs)
  check_well_formed(seqs)
  full = forward_log_probs(model, params, inputs, seqs)
  np.testing.assert_allclose(log_probs, full, rtol=1e-4, atol=1e-4)


def run_sample(model, params, inputs, seed=0, **kwargs):
  fn = jitted(transformer_sample, model, max_length=16, **kwargs)
  return tuple(map(np.asarray, fn(params, inputs, jax.random.key(seed))))


@pytest.mark.parametrize('settings', [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)])
def test_degenerate_sampling_is_greedy(medium, settings):
  model, params, inputs = medium
  greedy_seqs, _ = jitted(transformer_greedy_search, model, max_length=16)(params, inputs)
  seqs, _ = run_sample(model, params, inputs, num_samples=3, **{'temperature': 2.0, **settings})
  np.testing.assert_array_equal(seqs, np.repeat(np.asarray(greedy_seqs)[:, None], 3, axis=1))


def test_sampling_is_deterministic_under_the_rng_and_scores_are_model_log_probs(medium):
  model, params, inputs = medium
  seqs, log_probs = run_sample(model, params, inputs, seed=3, num_samples=8)
  again, _ = run_sample(model, params, inputs, seed=3, num_samples=8)
  other, _ = run_sample(model, params, inputs, seed=4, num_samples=8)
  np.testing.assert_array_equal(seqs, again)
  assert not np.array_equal(seqs, other)
  check_well_formed(seqs)
  assert len({tuple(s) for s in seqs[0]}) > 1  # Samples of one sentence differ.
  full = forward_log_probs(model, params, np.repeat(inputs, 8, 0), seqs.reshape(-1, 16))
  np.testing.assert_allclose(log_probs.reshape(-1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('settings', [dict(top_k=3), dict(top_p=0.5)])
def test_truncated_sampling_stays_in_the_allowed_set(medium, settings):
  """Every sampled token is within the top-k / nucleus of the tempered model distribution."""
  model, params, inputs = medium
  temperature = 1.5
  seqs, _ = run_sample(model, params, inputs, num_samples=8, temperature=temperature,
                       **settings)
  flat = seqs.reshape(-1, 16)
  logits = forward_logits(model, params, np.repeat(inputs, 8, 0), flat)
  probs = np.asarray(jax.nn.softmax(logits / temperature), np.float64)
  probs[..., 0] = 0.0  # Padding is never sampled: the sampler renormalises without it,
  probs[:, 0, EOS_ID] = 0.0  # nor EOS first (min_length 1).
  more_probable = probs > np.take_along_axis(probs, flat[..., None], axis=-1)
  ranks = more_probable.sum(-1)
  # Sampled tokens, except a forced EOS at the length limit (the last position).
  real = (flat > 0) & (np.arange(16) < 15)
  if 'top_k' in settings:
    assert np.all(ranks[real] < settings['top_k'])
    assert np.any(ranks[real] == settings['top_k'] - 1)
  else:
    # Without padding the sampler's renormalised masses are larger: a weaker check.
    mass_before = np.where(more_probable, probs, 0.0).sum(-1)
    assert np.all(mass_before[real] < settings['top_p'] + 1e-5)
    assert np.any(ranks[real] > 0)


@pytest.mark.parametrize('vocab', [1000, 1021, 600])  # Blocks of 250, 128 (padded), 200.
def test_block_top_k_equals_top_k_over_every_extension(vocab):
  rng = np.random.default_rng(5)
  batch, beam, k = 6, 4, 8
  logits = rng.normal(size=(batch, beam, vocab)).astype(np.float32) * 3
  # Ties within and across hypotheses and blocks, and duplicate hypothesis scores.
  logits[0, :, :] = np.round(logits[0, :, :])
  logits[1, 1] = logits[1, 0]
  log_probs = jax.nn.log_softmax(jnp.asarray(logits))
  hypothesis_log_probs = rng.normal(size=(batch, beam)).astype(np.float32) - 5
  hypothesis_log_probs[1, 1] = hypothesis_log_probs[1, 0]
  hypothesis_log_probs[2, 1:] = -np.inf  # Step 0: one hypothesis.
  hypothesis_log_probs = jnp.asarray(hypothesis_log_probs)
  limits = np.array([50, 50, 50, 4, 4, 50], np.int32)  # Sentences 3, 4 at their last step.
  step = jnp.asarray(3, jnp.int32)
  for force_full_length in (False, True):
    allowed = search._allowed_tokens(vocab, step, jnp.asarray(limits), force_full_length)
    want_scores, want_flat = search.top_k_extensions(log_probs, hypothesis_log_probs,
                                                       allowed, k)
    finite = np.isfinite(np.asarray(want_scores))
    assert finite[:3].all() and not finite[3:5].all()  # Sentences 3, 4: only EOS allowed.
    # From log-probs, and from logits (the Transformer's CPU beam search) normalised inside.
    for scores, from_logits in [(log_probs, False), (jnp.asarray(logits), True)]:
      got_scores, got_flat = jax.jit(cpu_decoding.block_top_k_extensions,
                                     static_argnums=(3, 4))(
          scores, hypothesis_log_probs, allowed, k, from_logits)
      np.testing.assert_array_equal(np.asarray(got_scores), np.asarray(want_scores))
      np.testing.assert_array_equal(np.asarray(got_flat)[finite],
                                    np.asarray(want_flat)[finite])
      assert np.asarray(got_flat).max() < beam * vocab


def test_beam_search_with_vocabulary_blocks_equals_plain_top_k(monkeypatch):
  model, params = make_model(600, seed=3, scale=1.0, eos_bias=0.0, cpu_tuned=True)
  # d_model < vocab: no direction reaches EOS alone; push along its embedding instead.
  eos = np.asarray(params['embed']['embedding'][EOS_ID])
  params['decoder']['layers_1']['feed_forward_sublayer']['norm']['bias'] = jnp.asarray(
      4.0 * eos / (eos @ eos), jnp.float32)
  inputs = random_sources(np.random.default_rng(2), [7, 3, 5, 1, 6, 2], 600)
  # Limits of source length + 4: some sentences also end at theirs, where only EOS is allowed.
  search = lambda: jax.jit(functools.partial(transformer_beam_search, model, beam_size=4,
                                             nbest=2, max_extra_length=4))(params, inputs)
  blocked = search()
  monkeypatch.setattr(cpu_decoding, 'block_size', lambda vocab: 10**6)  # Plain top_k.
  plain = search()
  np.testing.assert_array_equal(np.asarray(blocked[0]), np.asarray(plain[0]))
  np.testing.assert_array_equal(np.asarray(blocked[1]), np.asarray(plain[1]))
  lengths = (np.asarray(plain[0]) > 0).sum(-1)
  limits = np.array([7, 3, 5, 1, 6, 2]) + 4
  assert (lengths < limits[:, None]).any() and (lengths == limits[:, None]).any(), lengths


# --------------------------------------------------------------------------------------------
# The generic searches on a model that is not a Transformer, the variants, misuse.


def brute_force_trigram(log_table, vocab, max_len, limit, alpha, nbest, min_length=0):
  """Every sequence of real tokens ending in EOS within `limit` with at least `min_length`
  tokens before the EOS (fewer only at the limit), the best `nbest` by score;
  log_table[a, b, c] = log p(c | tokens a, b before it), with 0 before the start."""
  candidates, scores = [], []
  limit = min(limit, max_len)
  for n in range(min(min_length + 1, limit), limit + 1):
    for prefix in itertools.product(range(2, vocab), repeat=n - 1):
      seq = list(prefix) + [EOS_ID]
      padded = [0, 0] + seq
      total = sum(log_table[padded[i], padded[i + 1], padded[i + 2]] for i in range(n))
      candidates.append(seq + [0] * (max_len - n))
      scores.append(total / float(length_penalty(n, alpha)))
  order = np.argsort(-np.array(scores), kind='stable')[:nbest]
  return np.array(candidates)[order], np.array(scores)[order]


@pytest.mark.parametrize('min_length', [0, 2])
def test_generic_beam_search_with_a_trigram_model_equals_brute_force(min_length):
  """Not a Transformer: a trigram table whose cache is each hypothesis' previous token
  ([batch, beam], reordered by the default gather along the beam axis). With min_length 2
  no output ends before its third position, but a limit of 2 still ends at the second."""
  vocab, max_len, nbest, beam = 5, 5, 3, 64
  rng = np.random.default_rng(7)
  raw = rng.normal(size=(vocab, vocab, vocab)).astype(np.float32) * 2
  raw[..., EOS_ID] -= 1.0  # Outputs of several lengths.
  log_table = jax.nn.log_softmax(jnp.asarray(raw), axis=-1)
  limits = np.array([5, 3, 4, 2], np.int32)
  batch = len(limits)

  def step_fn(tokens, step, previous):
    return log_table[previous, tokens], tokens

  previous = jnp.zeros((batch, beam), jnp.int32)
  seqs, scores = jax.jit(functools.partial(
      beam_search, step_fn, batch_size=batch, beam_size=beam, max_length=max_len, alpha=ALPHA,
      nbest=nbest, length_limits=limits, min_length=min_length))(previous)
  check_well_formed(seqs)
  table = np.asarray(log_table, np.float64)
  for i in range(batch):
    want_seqs, want_scores = brute_force_trigram(table, vocab, max_len, limits[i], ALPHA, nbest,
                                                 min_length)
    np.testing.assert_array_equal(np.asarray(seqs[i]), want_seqs)
    np.testing.assert_allclose(np.asarray(scores[i]), want_scores, rtol=1e-5, atol=1e-5)
  assert len(set(output_lengths(np.asarray(seqs)).ravel())) > 2

  if min_length:
    assert output_lengths(np.asarray(seqs))[:3].min() > min_length
    assert (output_lengths(np.asarray(seqs))[3] == 2).all()  # Its limit.
  # Beam 1 with alpha 0 is greedy search, on the same step function.
  greedy, greedy_scores = greedy_search(step_fn, jnp.zeros((batch, 1), jnp.int32),
                                        batch_size=batch, max_length=max_len,
                                        length_limits=limits, min_length=min_length)
  beam1, beam1_scores = beam_search(step_fn, jnp.zeros((batch, 1), jnp.int32),
                                    batch_size=batch, beam_size=1, max_length=max_len,
                                    alpha=0.0, length_limits=limits, min_length=min_length)
  np.testing.assert_array_equal(np.asarray(greedy), np.asarray(beam1[:, 0]))
  np.testing.assert_allclose(np.asarray(greedy_scores), np.asarray(beam1_scores[:, 0]),
                             rtol=1e-6)


@pytest.mark.parametrize('cpu_tuned', [False, True])
def test_a_nonempty_source_never_gets_an_empty_translation(cpu_tuned, monkeypatch):
  """A model whose EOS is by far the likeliest first token: every search of a Transformer
  (min_length 1) still puts a token before it, except for an empty source (a padding row),
  which ends at once; with min_length 0 the searches give EOS alone (checked but for
  sampling, which shares greedy search's loop)."""
  model, params = make_model(12, seed=3, scale=1.0, eos_bias=12.0, cpu_tuned=cpu_tuned)
  inputs = random_sources(np.random.default_rng(3), [5, 2, 0, 7, 1, 4], 12)
  searches = {
      'beam': functools.partial(transformer_beam_search, beam_size=3, nbest=2,
                                stopping='early'),
      'greedy': transformer_greedy_search,
      'sample': functools.partial(transformer_sample, rng=jax.random.key(1), num_samples=2)}
  if cpu_tuned:
    # The CPU kernels change greedy search and sampling only in their cache layout; beam
    # search's top-k and continuous batching's loop are their own.
    del searches['greedy'], searches['sample']
    monkeypatch.setattr(continuous_batching, 'ENCODER_BLOCK_POSITIONS', 32)
    rows = np.pad(inputs, ((0, 2), (0, 0)))  # Two rows of padding after the queue.
    searches['continuous'] = lambda model, params, inputs, **kw: (
        continuous_batching.transformer_continuous_beam_search(
            model, params, rows, len(inputs), slots=2, refill=1, beam_size=3, nbest=2,
            stopping='early', **kw)[0][:len(inputs)],)
  for name, search_fn in searches.items():
    seqs = np.asarray(jax.jit(functools.partial(search_fn, model))(params, inputs)[0])
    lengths = output_lengths(seqs).reshape(len(inputs), -1)
    empty_source = (inputs == 0).all(1)
    assert (lengths[empty_source] == 1).all(), name
    assert (lengths[~empty_source] >= 2).all(), (name, lengths)
    if name != 'sample':
      unbounded = np.asarray(jax.jit(functools.partial(search_fn, model, min_length=0))(
          params, inputs)[0])
      assert (output_lengths(unbounded).reshape(len(inputs), -1)[:, 0] == 1).all(), name


def test_min_length_must_be_a_count_and_alpha_finite_and_not_negative():
  """Before: alpha nan gave every sentence an empty output, without an error."""
  step_fn = lambda tokens, step, cache: (jnp.zeros(tokens.shape + (5,)), cache)
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match='min_length must be an integer >= 0'):
      beam_search(step_fn, None, batch_size=1, beam_size=2, max_length=4, min_length=bad)
  for bad in (float('nan'), float('inf'), -0.5):
    with pytest.raises(ValueError, match='alpha .* must be a finite number >= 0'):
      beam_search(step_fn, None, batch_size=1, beam_size=2, max_length=4, alpha=bad)


@pytest.mark.parametrize('search', ['beam', 'greedy', 'sample'])
def test_output_longer_than_the_positional_table_is_an_error(medium, search):
  model, params, inputs = medium  # max_len 64.
  fn = {'beam': transformer_beam_search, 'greedy': transformer_greedy_search,
        'sample': functools.partial(transformer_sample, rng=jax.random.key(0))}[search]
  with pytest.raises(ValueError, match=r'max_length=65 .*max_len=64'):
    fn(model, params, inputs, max_length=65)
  # The default length is capped by max_len: a long source is fine.
  wide = np.pad(inputs, ((0, 0), (0, 64 - inputs.shape[1])))
  assert jax.eval_shape(lambda: fn(model, params, wide))[0].shape[-1] == 64


@pytest.mark.parametrize('seed', [0, 1])
def test_cpu_tuned_and_default_searches_give_identical_outputs(medium, seed):
  inputs = medium[2]
  model, params = make_model(20, seed=seed, scale=1.0, eos_bias=3.0, cpu_tuned=True)
  default = Transformer(dataclasses.replace(model.config, cpu_tuned=False))
  # max_length 40: four loop pieces on the CPU path (chunk_ends), the last a partial one.
  for fn, settings in [(transformer_beam_search, dict(beam_size=4, nbest=2, max_length=40)),
                       (transformer_greedy_search, dict(max_length=40))]:
    cpu_seqs, cpu_scores = jitted(fn, model, **settings)(params, inputs)
    seqs, scores = jitted(fn, default, **settings)(params, inputs)
    np.testing.assert_array_equal(np.asarray(cpu_seqs), np.asarray(seqs))
    np.testing.assert_allclose(np.asarray(cpu_scores), np.asarray(scores), rtol=1e-5, atol=1e-5)
  assert len(set(output_lengths(np.asarray(seqs)))) > 1


def test_chunk_ends_double_up_to_the_buffer_length():
  assert search.chunk_ends(66, 8) == [8, 16, 32, 66]  # Not a 2-step piece after 64.
  assert search.chunk_ends(90, 8) == [8, 16, 32, 64, 90]
  assert search.chunk_ends(40, 8) == [8, 16, 32, 40]
  assert search.chunk_ends(64, 8) == [8, 16, 32, 64]
  assert search.chunk_ends(256, 8) == [8, 16, 32, 64, 128, 256]
  assert search.chunk_ends(5, 8) == [5]


def _bigram_step(table):
  log_probs = jnp.log(jnp.asarray(table, jnp.float32))
  return lambda tokens, step, cache: (log_probs[tokens], cache)


def test_early_stopping_bounds_live_hypotheses_at_the_next_step_not_the_limit():
  """A bigram model where EOS is likely first but a long chain of 'c' (token 4) scores best
  under a strong length penalty (alpha 2). At step 0 the finished 'EOS' (log 0.5 / 1) beats
  the best live 'a' ended at the next step (log 0.3 / ((5 + 2) / 6) ** 2): the early rule
  stops there; the exact search goes on and finds the long output."""
  pad, eos, a, b, c = range(5)
  table = np.full((5, 5), 1e-6)
  table[pad] = [1e-6, 0.5, 0.3, 0.2, 1e-6]  # Start: EOS, 'a' or 'b'.
  table[a] = [1e-6, 0.9, 1e-6, 1e-6, 0.1]  # 'a': EOS, or the start of a chain of 'c'.
  table[b] = [1e-6, 0.9, 1e-6, 0.1, 1e-6]
  table[c] = [1e-6, 0.01, 1e-6, 1e-6, 0.99]
  table /= table.sum(axis=1, keepdims=True)
  step_fn, alpha, length = _bigram_step(table), 2.0, 20

  def search(stopping):
    return map(np.asarray, jax.jit(lambda: beam_search(
        step_fn, jnp.zeros((1, 2)), batch_size=1, beam_size=2, max_length=length, alpha=alpha,
        stopping=stopping))())

  seqs, scores = search('early')
  np.testing.assert_array_equal(seqs[0, 0], [eos] + [0] * (length - 1))
  np.testing.assert_allclose(scores[0, 0], np.log(table[pad, eos]), rtol=1e-5)
  exact_seqs, exact_scores = search('exact')
  assert output_lengths(exact_seqs[0, 0]) > 3 and exact_scores[0, 0] > scores[0, 0] + 0.1


def test_early_stopping_is_exact_without_a_length_penalty(medium):
  model, params, inputs = medium
  results = [jitted(transformer_beam_search, model, beam_size=3, nbest=2, alpha=0.0,
                    max_length=24, stopping=stopping)(params, inputs)
             for stopping in ('exact', 'early')]
  (exact_seqs, exact_scores), (seqs, scores) = jax.device_get(results)
  np.testing.assert_array_equal(seqs, exact_seqs)
  np.testing.assert_allclose(scores, exact_scores, rtol=1e-6)
  assert len(set(output_lengths(seqs[:, 0]))) > 2


def test_an_all_padding_row_gives_eos_at_once_and_changes_no_other_row(medium):
  model, params, inputs = medium
  padded = np.concatenate([inputs, np.zeros_like(inputs[:1])])
  search = jitted(transformer_beam_search, model, beam_size=4, nbest=2, max_length=16)
  seqs, scores = map(np.asarray, search(params, inputs))
  padded_seqs, padded_scores = map(np.asarray, search(params, padded))
  np.testing.assert_array_equal(padded_seqs[:-1], seqs)
  np.testing.assert_allclose(padded_scores[:-1], scores, rtol=1e-6)
  np.testing.assert_array_equal(padded_seqs[-1, 0], [EOS_ID] + [0] * 15)


@pytest.mark.parametrize('cpu_tuned', [True, False])
def test_token_log_probs_equal_the_forward_pass(medium, cpu_tuned):
  """Per-token log-probabilities of every nbest output, against teacher forcing; they sum to
  the score times the length penalty."""
  _, params, inputs = medium
  model, _ = make_model(20, seed=1, scale=1.0, eos_bias=1.5, cpu_tuned=cpu_tuned)
  seqs, scores, token_lps = map(np.asarray, jitted(
      transformer_beam_search, model, beam_size=4, nbest=2, max_length=16,
      token_log_probs=True)(params, inputs))
  for k in range(2):
    logits = np.asarray(forward_logits(model, params, inputs, seqs[:, k]))
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                                  seqs[:, k, :, None], axis=-1)[..., 0]
    after_eos = np.arange(16) >= output_lengths(seqs[:, k])[:, None]
    np.testing.assert_allclose(token_lps[:, k], np.where(after_eos, 0.0, expected), atol=1e-4)
    penalties = np.asarray(length_penalty(output_lengths(seqs[:, k]), ALPHA))
    np.testing.assert_allclose(token_lps[:, k].sum(-1) / penalties, scores[:, k], rtol=1e-5)
  assert len(set(output_lengths(seqs[:, 0]))) > 1


def test_a_target_prefix_starts_the_output_and_the_search_continues_it_exactly():
  """An exhaustive beam (vocab 5, <= 4 tokens): with a forced first token that the free best
  output does not start with, the result is the best of all sequences that start with it
  (brute force), under the same length penalty."""
  vocab, max_len = 5, 4
  model, params = make_model(vocab, seed=4)
  source_lengths = [6, 6, 2, 3, 1, 6]
  inputs = random_sources(np.random.default_rng(0), source_lengths, vocab)
  free, _ = map(np.asarray, jitted(transformer_beam_search, model, beam_size=36, alpha=ALPHA,
                                   max_length=max_len, max_extra_length=1)(params, inputs))
  prefix = np.where(free[:, 0, :1] == 3, 4, 3).astype(np.int32)  # [batch, 1]
  seqs, scores = map(np.asarray, jax.jit(functools.partial(
      transformer_beam_search, model, beam_size=36, alpha=ALPHA, max_length=max_len,
      max_extra_length=1))(params, inputs, prefix=jnp.asarray(prefix)))
  candidates = np.array([list(rest) + [EOS_ID] + [0] * (max_len - n)
                         for n in range(1, max_len + 1)
                         for rest in itertools.product(range(2, vocab), repeat=n - 1)])
  lengths = output_lengths(candidates)
  for i, source_length in enumerate(source_lengths):
    # The limit is min(source length + 1, 4), and at least the prefix and one token more.
    allowed = candidates[(lengths <= max(2, min(source_length + 1, max_len)))
                         & (candidates[:, 0] == prefix[i, 0])]
    log_probs = forward_log_probs(model, params, np.repeat(inputs[i:i + 1], len(allowed), 0),
                                  allowed)
    brute = log_probs / np.asarray(length_penalty(output_lengths(allowed), ALPHA))
    np.testing.assert_array_equal(seqs[i, 0], allowed[np.argmax(brute)])
    np.testing.assert_allclose(scores[i, 0], brute.max(), rtol=1e-5, atol=1e-5)


def test_an_ensemble_of_one_is_the_model_and_of_two_averages_log_probs(medium):
  from model import transformer_ensemble_beam_search
  model, params, inputs = medium
  settings = dict(beam_size=4, nbest=2, max_length=16)
  single = jax.device_get(jitted(transformer_beam_search, model, **settings)(params, inputs))
  alone = jax.device_get(jax.jit(functools.partial(
      transformer_ensemble_beam_search, [model], **settings))([params], inputs))
  np.testing.assert_array_equal(alone[0], single[0])
  np.testing.assert_allclose(alone[1], single[1], rtol=1e-5)

  # A second member of another size, on the default (not CPU-tuned) path.
  other, other_params = make_model(20, seed=7, scale=1.0, eos_bias=1.5, cpu_tuned=False)
  other = Transformer(dataclasses.replace(other.config, d_model=48, num_heads=3))
  other_params = jax.jit(other.init)(jax.random.key(7), inputs[:1], inputs[:1])['params']
  weights = [0.75, 0.25]
  seqs, scores = jax.device_get(jax.jit(functools.partial(
      transformer_ensemble_beam_search, [model, other], weights=weights, **settings))(
          [params, other_params], inputs))
  check_well_formed(seqs)
  for k in range(2):
    mean = sum(w * forward_log_probs(m, p, inputs, seqs[:, k])
               for w, m, p in zip(weights, (model, other), (params, other_params)))
    penalties = np.asarray(length_penalty(output_lengths(seqs[:, k]), ALPHA))
    np.testing.assert_allclose(scores[:, k], mean / penalties, rtol=1e-4, atol=1e-4)
  assert (seqs[:, 0] != single[0][:, 0]).any()  # The second member changes the outputs.
  # Members scoring different ids (TransformerConfig.output_vocab_size) cannot be averaged.
  fewer = Transformer(dataclasses.replace(other.config, output_vocab_size=16))
  with pytest.raises(ValueError, match='share the vocabulary size and the output layer'):
    transformer_ensemble_beam_search([model, fewer], [params, other_params], inputs, **settings)


# --------------------------------------------------------------------------------------------
# Continuous batching.


def test_pack_queue_packs_first_fit_in_order_and_places_every_token_where_origin_says():
  """Sentences of 9, 7, 7, 4, 3, 2 and 1 tokens (an empty row among them, two rows of
  padding after) in rows of 16: each goes to the first row with room at its turn."""
  rng = np.random.default_rng(0)
  lengths = [9, 7, 7, 0, 4, 3, 2, 1, 0, 0]
  rows = np.zeros((len(lengths), 16), np.int32)
  for i, n in enumerate(lengths):
    rows[i, :n] = rng.integers(3, 50, size=n)
  queue = jax.tree_util.tree_map(np.asarray, jax.jit(continuous_batching.pack_queue)(rows))
  packed, segmentation, origin = queue['sources'], queue['segmentation'], queue['origin']
  assert packed.shape == (10, 16) and origin.shape == (10, 16)
  starts = [(row, offset) for row, offset in zip(*divmod(origin[:, 0], 16))]
  want = {0: (0, 0), 1: (0, 9), 2: (1, 0), 4: (1, 7), 5: (1, 11), 6: (1, 14), 7: (2, 0)}
  assert {i: starts[i] for i in want} == want
  for i, n in enumerate(lengths):
    where = origin[i, :n]
    np.testing.assert_array_equal(packed.reshape(-1)[where], rows[i, :n])
    assert np.all(segmentation.reshape(-1)[where] == i + 1)
    assert np.all(origin[i, n:] == -1)
  assert np.count_nonzero(segmentation) == sum(lengths) and not packed[3:].any()


@pytest.mark.parametrize('stopping,nbest,attention', [
    ('early', 1, {}), ('exact', 2, {}),
    ('early', 1, dict(attention_score='additive', attention_probs='sparsemax'))])
def test_continuous_batching_gives_each_sentence_the_batch_search_result(stopping, nbest,
                                                                        attention, monkeypatch):
  """20 sentences through 4 slots (refilled 2 at a time): every sentence's outputs and scores
  are those of the batch search, whichever sentences it shared the loop with. The packed
  sources are encoded in several blocks; the cache has several chunks (8, 16, 30 steps)."""
  monkeypatch.setattr(continuous_batching, 'ENCODER_BLOCK_POSITIONS', 32)
  monkeypatch.setattr(continuous_batching, 'FIRST_CHUNK_LENGTH', 8)
  model, params = make_model(20, seed=1, scale=1.0, eos_bias=1.2, cpu_tuned=True, **attention)
  lengths = np.random.default_rng(4).integers(1, 12, size=20)
  sources = random_sources(np.random.default_rng(5), lengths, 20)
  order = np.argsort(-lengths, kind='stable')
  queue = np.pad(sources[order], [(0, 4), (0, 0)])  # 4 rows of padding after the queue.
  settings = dict(beam_size=4, nbest=nbest, stopping=stopping, max_length=30,
                  max_extra_length=18)
  seqs, scores = jitted(continuous_batching.transformer_continuous_beam_search, model,
                        slots=4, refill=2, **settings)(params, queue, 20)
  want_seqs, want_scores = jitted(transformer_beam_search, model, **settings)(
      params, sources[order])
  np.testing.assert_array_equal(np.asarray(seqs)[:20], np.asarray(want_seqs))
  np.testing.assert_allclose(np.asarray(scores)[:20], np.asarray(want_scores), rtol=1e-5,
                             atol=1e-5)
  assert np.all(np.asarray(scores)[20:] == -np.inf)
  # Sentences end at many steps (slots refill at different times), some in the cache's
  # later chunks (chunk_ends: 8, 16, 30).
  lengths_out = output_lengths(np.asarray(seqs)[:20, 0])
  assert len(set(lengths_out)) > 3 and lengths_out.max() > 16


def test_continuous_batching_needs_the_cpu_decoding_cache_and_rows_of_sources():
  model, params = make_model(20, cpu_tuned=False)
  queue = np.array([[5, 6, EOS_ID]], np.int32)
  with pytest.raises(ValueError, match='CPU decoding cache'):
    continuous_batching.transformer_continuous_beam_search(model, params, queue, 1, slots=2,
                                                           refill=1)
  model, params = make_model(20, cpu_tuned=True)
  with pytest.raises(ValueError, match=r'sources must be token ids \[queue, width\]'):
    continuous_batching.transformer_continuous_beam_search(model, params, queue[0], 1, slots=2,
                                                           refill=1)
