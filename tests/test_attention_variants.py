"""Tests of the attention variants beside the paper's: dot-product without scaling, bilinear
and additive scores, sparsemax and 1.5-entmax (model/probability_maps.py), and linear
attention (model/linear_attention.py)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoding import (
  ALPHA,
  check_well_formed,
  forward_log_probs,
  jitted,
  make_model,
  output_lengths,
  random_sources,
)
from test_model import (
  SRC,
  TGT,
  VOCAB,
  CachedDecoder,
  init_params,
  make_forward,
  max_abs,
  random_tokens,
  small_config,
)

from model import EOS_ID, Transformer, length_penalty, linear_attention, transformer_beam_search

VARIANTS = {
    'dot': dict(attention_score='dot'),
    'bilinear': dict(attention_score='bilinear'),
    'additive': dict(attention_score='additive'),
    'sparsemax': dict(attention_probs='sparsemax'),
    'entmax15': dict(attention_probs='entmax15'),
    'linear': dict(linear_attention=True),
}
# One layer each (compiling dominates); slow-marked cases repeat what a fast one checks of a
# code path that the variants share.
ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)


def random_qkv(rng, batch, q_len, k_len, heads=2, head_dim=4):
  draw = lambda length: jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)),
                                    jnp.float32)
  return draw(q_len), draw(k_len), draw(k_len)


def segment_mask(query_segments, key_segments, causal):
  mask = (query_segments[:, None, :, None] == key_segments[:, None, None, :])
  mask &= (query_segments > 0)[:, None, :, None]
  if causal:
    mask &= np.tril(np.ones((query_segments.shape[1],) * 2, bool))
  return mask


def test_linear_attention_prefix_sums_equal_the_recurrent_and_quadratic_forms():
  rng = np.random.default_rng(0)
  query, keys, values = random_qkv(rng, 2, 9, 9)
  segments = np.array([[1] * 9, [1] * 6 + [0] * 3], np.int32)  # Row 1 padded.
  prefix = linear_attention.attention(query, keys, values, segments, segments, causal=True,
                                      packed=False)
  quadratic = linear_attention.quadratic_attention(query, keys, values,
                                                   segment_mask(segments, segments, True))
  assert max_abs(prefix, quadratic) < 1e-5
  # The recurrent form: a state of constant size, one key/value added per step.
  state = linear_attention.initial_state((2, 1), 2, 4)
  for t in range(9):
    state = linear_attention.add_to_state(state, keys[:, t:t + 1], values[:, t:t + 1])
    recurrent = linear_attention.read(query[:, t:t + 1], state)
    assert max_abs(recurrent[0], prefix[0, t:t + 1]) < 1e-5
    if t < 6:
      assert max_abs(recurrent[1], prefix[1, t:t + 1]) < 1e-5
  assert np.all(np.asarray(prefix[1, 6:]) == 0)  # Padding queries read nothing.
  # The check can fail: without the causal limit the first query reads later keys.
  full = linear_attention.attention(query, keys, values, segments, segments, causal=False,
                                    packed=False)
  assert max_abs(full[:, 0], prefix[:, 0]) > 1e-3


@pytest.mark.parametrize('causal', [False, True])
def test_linear_attention_of_packed_rows_stays_within_each_segment(causal):
  rng = np.random.default_rng(1)
  query, keys, values = random_qkv(rng, 2, 10, 10)
  segments = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 0, 0], [1] * 4 + [2] * 6], np.int32)
  packed = linear_attention.attention(query, keys, values, segments, segments, causal=causal,
                                      packed=True)
  quadratic = linear_attention.quadratic_attention(query, keys, values,
                                                   segment_mask(segments, segments, causal))
  assert max_abs(packed, quadratic) < 1e-5
  # Segment 2 of row 0 alone, unpacked, gives the same.
  alone = linear_attention.attention(query[:1, 3:7], keys[:1, 3:7], values[:1, 3:7],
                                     np.ones((1, 4), np.int32), np.ones((1, 4), np.int32),
                                     causal=causal, packed=False)
  assert max_abs(alone[0], packed[0, 3:7]) < 1e-5


def test_linear_cross_attention_of_packed_rows_reads_the_source_segment():
  rng = np.random.default_rng(2)
  query, keys, values = random_qkv(rng, 1, 6, 8)
  query_segments = np.array([[1, 1, 2, 2, 2, 0]], np.int32)
  key_segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
  packed = linear_attention.attention(query, keys, values, query_segments, key_segments,
                                      causal=False, packed=True)
  quadratic = linear_attention.quadratic_attention(
      query, keys, values, segment_mask(query_segments, key_segments, False))
  assert max_abs(packed, quadratic) < 1e-5
  assert np.all(np.asarray(packed[0, 5]) == 0)


@pytest.mark.slow
def test_bilinear_scores_start_as_the_scaled_dot_product():
  paper, bilinear = small_config(), small_config(attention_score='bilinear')
  params = init_params(paper)
  # The same weights, plus the bilinear kernels as initialised (identity / sqrt(head_dim)).
  merged = _with_weights_of(init_params(bilinear), params)
  rng = np.random.default_rng(3)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  want = make_forward(paper)(params, inputs, targets)
  got = make_forward(bilinear)(merged, inputs, targets)
  assert max_abs(want, got) < 1e-5


def _with_weights_of(tree, source):
  """`tree` with every entry that `source` also has replaced by source's."""
  if not isinstance(tree, dict):
    return source
  return {name: _with_weights_of(value, source[name]) if name in source else value
          for name, value in tree.items()}


@pytest.mark.parametrize('variant', [
    pytest.param(name, marks=[] if name in ('linear', 'additive', 'sparsemax') else
                 pytest.mark.slow) for name in VARIANTS])
def test_variant_is_causal_padding_invariant_and_packs(variant):
  config = small_config(dropout_rate=0.0, **ONE_LAYER, **VARIANTS[variant])
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(4)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  base = np.asarray(forward(params, inputs, targets))
  changed = targets.copy()
  changed[:, 3] = 3 + (changed[:, 3] - 3 + 11) % (VOCAB - 3)
  logits = np.asarray(forward(params, inputs, changed))
  assert max_abs(logits[:, :4], base[:, :4]) < 1e-5
  assert max_abs(logits[:, 4:], base[:, 4:]) > 1e-3
  # Padding: row 1 cut to source 3 / target 2 tokens and padded equals itself alone.
  padded_inputs, padded_targets = np.pad(inputs, ((0, 0), (0, 2))), targets.copy()
  padded_inputs[1, 3:], padded_targets[1, 2:] = 0, 0
  batched = np.asarray(forward(params, padded_inputs, padded_targets))
  assert max_abs(batched[0], base[0]) < 1e-5
  alone = np.asarray(forward(params, inputs[1:, :3], targets[1:, :2]))
  assert max_abs(batched[1, :2], alone[0]) < 1e-5
  # Packing: both rows' pairs in one row equal each row alone.
  packed_inputs = np.concatenate([inputs[0], inputs[1, :3], [0]])[None]
  packed_targets = np.concatenate([targets[0], targets[1, :2], [0]])[None]
  segmentation = lambda first, second, pad: np.array([[1] * first + [2] * second + [0] * pad])
  packed = np.asarray(forward(params, packed_inputs, packed_targets,
                              inputs_segmentation=segmentation(7, 3, 1),
                              targets_segmentation=segmentation(6, 2, 1)))
  assert max_abs(packed[0, :6], base[0]) < 1e-4
  assert max_abs(packed[0, 6:8], alone[0]) < 1e-4


@pytest.mark.parametrize('variant, cpu_tuned', [
    # CPU-tuned decoding computes the scores its own way; linear attention never uses it.
    pytest.param(name, cpu_tuned, marks=[] if cpu_tuned != (name == 'linear') and
                 name != 'sparsemax' else pytest.mark.slow)
    for name in VARIANTS for cpu_tuned in (True, False)])
def test_variant_cached_decoding_matches_forward(variant, cpu_tuned):
  config = small_config(cpu_tuned=cpu_tuned, **ONE_LAYER, **VARIANTS[variant])
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(5)
  batch, beam, length = 2, 2, 5
  inputs = random_tokens(rng, SRC)
  inputs[0, 5:] = 0
  targets = random_tokens(rng, (batch, beam, length))  # A different prefix in every slot.
  full = np.asarray(forward(params, np.repeat(inputs, beam, axis=0),
                            targets.reshape(batch * beam, length)))
  full = full.reshape(batch, beam, length, VOCAB)
  decoder = CachedDecoder(config, params, inputs, beam_size=beam, max_length=length)
  decoder_inputs = np.pad(targets, ((0, 0), (0, 0), (1, 0)))
  for t in range(length):
    logits = decoder.step(decoder_inputs[:, :, t], t)
    assert max_abs(logits, full[:, :, t]) < 1e-4, f'step {t}'


@pytest.mark.parametrize('variant', [
    pytest.param(name, marks=[] if name in ('entmax15', 'linear') else pytest.mark.slow)
    for name in VARIANTS])
def test_variant_trains(variant):
  """Gradients of the training loss (dropout on) are finite and move every parameter."""
  config = small_config(**ONE_LAYER, **VARIANTS[variant])
  params = init_params(config)
  rng = np.random.default_rng(7)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  model = Transformer(config)

  def loss(params):
    logits = model.apply({'params': params}, inputs, targets, train=True,
                         rngs={'dropout': jax.random.key(0)})
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

  grads = jax.jit(jax.grad(loss))(params)
  for path, grad in jax.tree_util.tree_leaves_with_path(grads):
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad)), path
    assert np.any(grad != 0), path


def test_linear_attention_decoding_state_does_not_grow():
  config = small_config(linear_attention=True, cpu_tuned=False)
  params = init_params(config)
  inputs = random_tokens(np.random.default_rng(6), SRC)
  shapes = [jax.tree_util.tree_map(jnp.shape, CachedDecoder(config, params, inputs, 2, n).cache)
            for n in (4, 30)]
  assert shapes[0] == shapes[1]


def test_linear_attention_beam_search_is_exact_with_an_exhaustive_beam():
  """As for the paper's model (test_decoding.py): beam search over a linear-attention model
  (its states reordered with the beams) returns the best outputs of brute force."""
  vocab, max_len = 5, 4
  model, params = make_model(vocab, seed=4, linear_attention=True)
  source_lengths = [6, 2, 3, 6]
  inputs = random_sources(np.random.default_rng(0), source_lengths, vocab)
  seqs, scores = map(np.asarray, jitted(
      transformer_beam_search, model, beam_size=36, alpha=ALPHA, max_length=max_len,
      max_extra_length=1)(params, inputs))
  check_well_formed(seqs)
  candidates = np.array([list(prefix) + [EOS_ID] + [0] * (max_len - n)
                         for n in range(1, max_len + 1)
                         for prefix in itertools.product(range(2, vocab), repeat=n - 1)])
  lengths = output_lengths(candidates)
  for i, source_length in enumerate(source_lengths):
    allowed = candidates[lengths <= min(source_length + 1, max_len)]
    log_probs = forward_log_probs(model, params, np.repeat(inputs[i:i + 1], len(allowed), 0),
                                  allowed)
    brute = log_probs / np.asarray(length_penalty(output_lengths(allowed), ALPHA))
    np.testing.assert_array_equal(seqs[i, 0], allowed[np.argmax(brute)])
    np.testing.assert_allclose(scores[i, 0], brute.max(), rtol=1e-5, atol=1e-5)


def test_variant_config_errors():
  with pytest.raises(ValueError, match='attention_score must be one of'):
    small_config(attention_score='cosine')
  with pytest.raises(ValueError, match='linear_attention replaces'):
    small_config(linear_attention=True, attention_score='additive')
  with pytest.raises(ValueError, match='attention_dropout_rate=0'):
    small_config(linear_attention=True, attention_dropout_rate=0.1)
