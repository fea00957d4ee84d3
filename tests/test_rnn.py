"""Tests of the attentional RNN baseline (model/rnn.py): causality, padding and packing
invariance, cached decoding equal to the teacher-forced pass, beam search equal to brute force,
and a run through train.py, checkpoint averaging and decode.py."""

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoding import ALPHA, check_well_formed, forward_log_probs, jitted, output_lengths
from test_train import needs_multi30k, small_config

import decode
import plot_attention
import train
from model import EOS_ID, RNN, RNNConfig, length_penalty, make_model, transformer_beam_search
from nmt import checkpoints

VOCAB = 31
EOS_BIAS = -5.0  # With the weights doubled, EOS is rare but not absent.


def rnn_config(**overrides) -> RNNConfig:
  settings = dict(vocab_size=VOCAB, embed_dim=12, hidden_dim=16, num_encoder_layers=2,
                  num_decoder_layers=2, dropout_rate=0.0, max_len=32)
  return RNNConfig(**{**settings, **overrides})


@functools.cache
def model_and_params(config: RNNConfig, scale: float = 1.0):
  model = RNN(config)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), dummy, dummy)['params']
  return model, jax.tree_util.tree_map(lambda p: p * scale, params)


@functools.cache
def forward(config: RNNConfig):
  model, params = model_and_params(config)
  apply = jax.jit(lambda inputs, targets, **kw: model.apply({'params': params}, inputs, targets,
                                                            **kw))
  return lambda inputs, targets, **kw: np.asarray(apply(jnp.asarray(inputs),
                                                        jnp.asarray(targets), **kw))


def tokens(rng, shape):
  return rng.integers(3, VOCAB, size=shape).astype(np.int32)


def max_abs(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_causal_padding_and_packing_invariant():
  config = rnn_config()
  run = forward(config)
  rng = np.random.default_rng(0)
  inputs, targets = tokens(rng, (2, 7)), tokens(rng, (2, 6))
  base = run(inputs, targets)
  # Causality: target j is read at step j + 1 only.
  changed = targets.copy()
  changed[:, 3] = 3 + (changed[:, 3] - 3 + 7) % (VOCAB - 3)
  logits = run(inputs, changed)
  assert max_abs(logits[:, :4], base[:, :4]) < 1e-6
  assert max_abs(logits[:, 4:], base[:, 4:]) > 1e-4
  # Padding: row 1 cut to source 3 / target 2 tokens and padded equals itself alone (the
  # backward encoder direction must start at the last real token).
  padded_inputs, padded_targets = np.pad(inputs, ((0, 0), (0, 2))), targets.copy()
  padded_inputs[1, 3:], padded_targets[1, 2:] = 0, 0
  batched = run(padded_inputs, padded_targets)
  assert max_abs(batched[0], base[0]) < 1e-5
  alone = run(inputs[1:, :3], targets[1:, :2])
  assert max_abs(batched[1, :2], alone[0]) < 1e-5
  # Packing: both pairs in one row equal each alone.
  packed_inputs = np.concatenate([inputs[0], inputs[1, :3], [0]])[None]
  packed_targets = np.concatenate([targets[0], targets[1, :2], [0]])[None]
  segmentation = lambda first, second: np.array([[1] * first + [2] * second + [0]])
  packed = run(packed_inputs, packed_targets, inputs_segmentation=segmentation(7, 3),
               targets_segmentation=segmentation(6, 2))
  assert max_abs(packed[0, :6], base[0]) < 1e-5
  assert max_abs(packed[0, 6:8], alone[0]) < 1e-5
  # The check can fail: unsegmented, the second pair sees the first.
  one = lambda t: (t > 0).astype(np.int32)
  unsegmented = run(packed_inputs, packed_targets, inputs_segmentation=one(packed_inputs),
                    targets_segmentation=one(packed_targets))
  assert max_abs(unsegmented[0, 6:8], alone[0]) > 1e-4


@pytest.mark.parametrize('score', ['additive', 'dot', 'general'])
def test_cached_decoding_matches_forward(score):
  config = rnn_config(attention_score=score, input_feeding=score != 'dot')
  model, params = model_and_params(config)
  rng = np.random.default_rng(1)
  batch, beam, length = 2, 3, 5
  inputs = tokens(rng, (batch, 6))
  inputs[1, 4:] = 0
  targets = tokens(rng, (batch, beam, length))  # A different prefix in every slot.
  full = forward(config)(np.repeat(inputs, beam, 0), targets.reshape(batch * beam, length))
  full = full.reshape(batch, beam, length, VOCAB)

  @jax.jit
  def start(inputs):
    return model.apply({'params': params}, inputs, method=lambda m, x: m.init_decode_cache(
        m.encode(x), x, beam, length))

  step = jax.jit(lambda tokens, t, cache: model.apply({'params': params}, tokens, t, cache,
                                                      method='decode_step'))
  cache = start(jnp.asarray(inputs))
  previous = np.pad(targets, ((0, 0), (0, 0), (1, 0)))
  for t in range(length):
    logits, cache = step(jnp.asarray(previous[:, :, t]), jnp.asarray(t), cache)
    assert max_abs(logits, full[:, :, t]) < 1e-5, f'step {t}'


def test_beam_search_is_exact_with_an_exhaustive_beam():
  vocab, max_len = 5, 4
  config = RNNConfig(vocab_size=vocab, embed_dim=8, hidden_dim=16, num_encoder_layers=1,
                     num_decoder_layers=1, dropout_rate=0.0, max_len=32)
  model, params = model_and_params(config, scale=2.0)  # Peakier distributions.
  # Biases that push the padding and EOS logits down, so that outputs end at varied lengths.
  bias = params['output_projection']['bias'].at[0].add(-4.0).at[EOS_ID].add(EOS_BIAS)
  params = {**params, 'output_projection': {**params['output_projection'], 'bias': bias}}
  source_lengths = [6, 2, 3, 6, 1]
  rng = np.random.default_rng(0)
  inputs = np.where(np.arange(6) < np.array(source_lengths)[:, None],
                    rng.integers(3, vocab, size=(5, 6)), 0).astype(np.int32)
  seqs, scores = map(np.asarray, jitted(
      transformer_beam_search, model, beam_size=36, alpha=ALPHA, max_length=max_len,
      max_extra_length=1, nbest=3)(params, inputs))
  check_well_formed(seqs)
  # At least one token before the EOS (the searches' min_length 1).
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
    order = np.argsort(-brute, kind='stable')[:3]
    np.testing.assert_array_equal(seqs[i], allowed[order])
    np.testing.assert_allclose(scores[i], brute[order], rtol=1e-5, atol=1e-5)
    best_lengths += list(output_lengths(allowed[order]))
  # Meaningful only if outputs of different lengths compete.
  assert len(set(best_lengths)) >= 3, best_lengths


def test_config_choices_and_errors():
  assert isinstance(make_model({'vocab_size': 10, 'd_model': 8, 'num_heads': 2}).config.d_model,
                    int)
  assert isinstance(make_model({'architecture': 'rnn', 'vocab_size': 10}), RNN)
  with pytest.raises(ValueError, match='architecture must be one of'):
    make_model({'architecture': 'lstm', 'vocab_size': 10})
  with pytest.raises(ValueError, match='attention_score must be one of'):
    rnn_config(attention_score='scaled_dot')


@needs_multi30k
def test_trains_averages_and_decodes_through_the_same_commands(tmp_path, one_device):
  config = small_config({'num_train_steps': 6, 'checkpoint_every_steps': 3,
                         'eval.every_steps': 6, 'eval.bleu_every_steps': 6,
                         'eval.bleu_sentences': 4})
  vocab_size = config.model.vocab_size
  config.data.target_pieces_first = False  # It sizes the Transformer's output layer.
  config.model = {'architecture': 'rnn', 'vocab_size': vocab_size, 'embed_dim': 16,
                  'hidden_dim': 32, 'num_encoder_layers': 1, 'num_decoder_layers': 1,
                  'dropout_rate': 0.1, 'max_len': 128}
  workdir = str(tmp_path / 'rnn')
  result = train.train_and_evaluate(config, workdir)
  assert result['step'] == 6 and np.isfinite(result['metrics']['eval_nll'])
  assert checkpoints.save_averaged(workdir, 2) == [3, 6]
  source = tmp_path / 'source.txt'
  source.write_text('A man is riding a bike .\nTwo dogs play .\n\n', encoding='utf-8')
  output = tmp_path / 'out.txt'
  decode.decode(workdir, input_path=str(source), output=str(output), checkpoint='averaged')
  lines = output.read_text(encoding='utf-8').split('\n')
  assert len(lines) == 4 and lines[2] == '' and os.path.getsize(output) > 0
  # Its attention, drawn: rows over the source sum to 1.
  written = plot_attention.plot(workdir, ['A man is riding a bike .'], str(tmp_path / 'att'),
                                targets=['Ein Mann fährt Rad .'])
  assert [os.path.basename(p) for p in written] == [
      '0_cross_attention_layer0.png', '0_cross_attention_mean.png', '0_attention.npz']
  weights = np.load(tmp_path / 'att' / '0_attention.npz')['cross_attention_layer0']
  assert weights.shape[0] == 1
  np.testing.assert_allclose(weights.sum(-1), 1, atol=1e-5)
