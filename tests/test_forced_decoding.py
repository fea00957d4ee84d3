"""model/forced_decoding.py: a model's scores and attention of given translations, against its
own full forward pass and against the beam search's own per-token scores."""

import jax
import jax.numpy as jnp
import numpy as np
from test_model import init_params, random_tokens, small_config

from model import EOS_ID, Transformer, transformer_beam_search
from model.forced_decoding import alignment, attention_maps, forced_decoding

CONFIG = small_config(dropout_rate=0.0, num_decoder_layers=2)


def pairs(rng):
  """Two pairs of different lengths in one padded batch: [2, 7] sources, [2, 6] targets."""
  inputs, targets = random_tokens(rng, (2, 7)), random_tokens(rng, (2, 6))
  inputs[0, 4], inputs[0, 5:] = EOS_ID, 0
  targets[0, 3], targets[0, 4:] = EOS_ID, 0
  inputs[1, 6], targets[1, 5] = EOS_ID, EOS_ID
  return inputs, targets


def test_forced_decoding_reads_the_forward_pass_and_its_cross_attention():
  model, params = Transformer(CONFIG), init_params(CONFIG)
  inputs, targets = pairs(np.random.default_rng(0))
  log_probs, cross = jax.jit(lambda p, x, y: forced_decoding(model, p, x, y))(
      params, inputs, targets)
  logits = model.apply({'params': params}, inputs, targets)
  expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[..., None],
                                axis=-1)[..., 0] * (targets > 0)
  np.testing.assert_allclose(log_probs, expected, atol=1e-5)
  _, maps = attention_maps(model, params, jnp.asarray(inputs), jnp.asarray(targets))
  assert cross.shape == (2, CONFIG.num_decoder_layers, 6, 7)
  for layer, weights in enumerate(maps['cross_attention']):  # [batch, heads, tgt, src]
    mean = np.asarray(weights).mean(axis=1) * (targets > 0)[..., None]
    np.testing.assert_allclose(cross[:, layer], mean, atol=1e-6)
  # Each real target row is a distribution over the real source tokens; padding rows are 0.
  sums = np.asarray(cross).sum(-1)
  np.testing.assert_allclose(sums[0, :, :4], 1.0, atol=1e-5)
  assert (sums[0, :, 4:] == 0).all() and (np.asarray(cross)[0, :, :4, 5:] == 0).all()
  # A pair alone equals the pair inside the padded batch.
  alone = forced_decoding(model, params, inputs[:1, :5], targets[:1, :4])
  np.testing.assert_allclose(alone[0][0], log_probs[0, :4], atol=1e-5)
  np.testing.assert_allclose(alone[1][0], np.asarray(cross)[0, :, :4, :5], atol=1e-5)
  assert alignment(cross).shape == (2, 6)
  np.testing.assert_array_equal(alignment(cross), np.asarray(cross).mean(1).argmax(-1))


def test_forced_decoding_of_the_beam_search_result_gives_its_token_scores():
  """Incremental decoding (the search) and the full forward pass agree on every token."""
  model, params = Transformer(CONFIG), init_params(CONFIG, seed=3)
  inputs = random_tokens(np.random.default_rng(1), (3, 6))
  inputs[:, -1] = EOS_ID
  sequences, _, token_log_probs = transformer_beam_search(
      model, params, inputs, beam_size=3, alpha=0.6, max_extra_length=6, token_log_probs=True)
  best = np.asarray(sequences)[:, 0]
  log_probs, _ = forced_decoding(model, params, inputs, best)
  np.testing.assert_allclose(log_probs, np.asarray(token_log_probs)[:, 0], atol=1e-4)
  real = np.asarray(log_probs)[best > 0]
  assert real.size > 6 and np.ptp(real) > 0.1  # Scores that differ from token to token.
