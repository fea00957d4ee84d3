"""Tests of plot_attention.py: the pictures and weights are written, and the weights are the
model's (recomputed by hand; rows sum to 1; sparse maps give exact zeros)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import plot_attention
from model import Transformer, TransformerConfig, sinusoidal_table
from nmt import checkpoints, runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pictures_and_weights_of_a_trained_run(trained_run, tmp_path):
  sentences = ['A man is riding a bike .', 'Two dogs play in the snow .']
  targets = ['Ein Mann fährt Fahrrad .', 'Zwei Hunde spielen im Schnee .']
  written = plot_attention.plot(trained_run, sentences, str(tmp_path), targets=targets)
  config, tokenizer, model = runs.load_run(trained_run)
  layers = config.model.num_encoder_layers
  assert len(written) == len(sentences) * (3 * layers + 2)
  assert all(os.path.getsize(path) > 1000 for path in written)
  params = checkpoints.load_params(trained_run)[0]

  saved = np.load(tmp_path / '1_attention.npz')
  source_ids, target_ids = tokenizer.encode(sentences[1:])[0], tokenizer.encode(targets[1:])[0]
  assert list(saved['source_pieces'])[-1] == '</s>' and len(saved['source_pieces']) == len(
      source_ids)
  encoder = saved['encoder_self_attention_layer0']  # [heads, source, source]
  cross = saved['cross_attention_layer0']  # [heads, target, source]
  decoder = saved['decoder_self_attention_layer0']  # [heads, target, target]
  heads = config.model.num_heads
  assert encoder.shape == (heads, len(source_ids), len(source_ids))
  assert cross.shape == (heads, len(target_ids), len(source_ids))
  for weights in (encoder, cross, decoder):
    np.testing.assert_allclose(weights.sum(-1), 1, atol=1e-5)
  assert np.all(np.triu(decoder, k=1) == 0)  # Causal: no weight on later outputs.

  # The first encoder layer's weights by hand: softmax(q.k / sqrt(head_dim)) of the embedded
  # source (embedding * sqrt(d_model) + the sinusoidal table).
  d = config.model.d_model
  x = (np.asarray(params['embed']['embedding'])[source_ids] * np.sqrt(d)
       + sinusoidal_table(len(source_ids), d))
  attention = params['encoder']['layers_0']['self_attention']
  query = np.einsum('td,dhe->the', x, attention['query']['kernel']) + attention['query']['bias']
  key = np.einsum('td,dhe->the', x, attention['key']['kernel'])
  logits = np.einsum('qhe,khe->hqk', query, key) / np.sqrt(d // heads)
  expected = np.exp(logits - logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(encoder, expected, atol=2e-5)


def test_sparse_maps_and_linear_attention_weights():
  rng = np.random.default_rng(0)
  inputs = np.append(rng.integers(3, 40, size=7), 1).astype(np.int32)
  targets = np.append(rng.integers(3, 40, size=5), 1).astype(np.int32)
  for variant in (dict(attention_probs='sparsemax'), dict(linear_attention=True)):
    config = TransformerConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32,
                               num_encoder_layers=1, num_decoder_layers=2, max_len=16,
                               **variant)
    model = Transformer(config)
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32),
                        jnp.ones((1, 4), jnp.int32))['params']
    # Peakier scores, so that sparsemax leaves keys out.
    params = jax.tree_util.tree_map(lambda p: p * 3, params)
    weights = plot_attention.attention_weights(model, params, inputs, targets)
    assert [len(weights[name]) for name in ('encoder_self_attention', 'decoder_self_attention',
                                            'cross_attention')] == [1, 2, 2]
    for layers in weights.values():
      for w in layers:
        np.testing.assert_allclose(w.sum(-1), 1, atol=1e-5)
    decoder = weights['decoder_self_attention'][0]
    assert np.all(np.triu(decoder, k=1) == 0)
    if 'attention_probs' in variant:  # Exact zeros beyond the causal ones.
      assert np.sum(np.tril(decoder) == 0) > 0
      assert np.sum(weights['cross_attention'][1] == 0) > 0
    else:  # Linear attention's weights are positive wherever allowed.
      assert np.all(weights['cross_attention'][0] > 0)


def test_command_line_mistakes_are_one_line_errors(tmp_path):
  result = subprocess.run(
      [sys.executable, 'plot_attention.py', '--workdir', str(tmp_path), '--output_dir',
       str(tmp_path / 'out'), '--sentences', 'a', '--input', 'x.txt'],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      'error: give exactly one of --sentences and --input.')
  result = subprocess.run(
      [sys.executable, 'plot_attention.py', '--workdir', str(tmp_path), '--output_dir',
       str(tmp_path / 'out'), '--sentences', 'a'],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr
  assert 'config.json not found' in result.stderr.strip().splitlines()[-1]
