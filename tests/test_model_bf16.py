"""bfloat16 compute: cached decoding against the full forward pass, and beam search on a
trained tiny model (reversing random sequences) against the same model in float32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import EOS_ID, Transformer, TransformerConfig, transformer_beam_search

VOCAB = 24


def config(**overrides) -> TransformerConfig:
  settings = dict(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                  num_decoder_layers=2, dropout_rate=0.0, max_len=16)
  return TransformerConfig(**{**settings, **overrides})


# The fast set checks the GPU/TPU path here; the CPU path's bfloat16 decoding is checked by
# the trained-model beam search test below.
@pytest.mark.parametrize('cpu_tuned', [pytest.param(True, marks=pytest.mark.slow), False])
def test_bfloat16_cached_decoding_matches_the_forward_pass(cpu_tuned):
  c16 = config(dtype='bfloat16', cpu_tuned=cpu_tuned, pre_norm=True)
  model = Transformer(c16)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(Transformer(config(pre_norm=True)).init)(jax.random.key(0), dummy, dummy)[
      'params']
  rng = np.random.default_rng(0)
  batch, beam, length = 2, 3, 6
  inputs = rng.integers(3, VOCAB, size=(batch, 7)).astype(np.int32)
  inputs[1, 4:] = 0
  targets = rng.integers(3, VOCAB, size=(batch, beam, length)).astype(np.int32)
  full = jax.jit(model.apply)({'params': params}, np.repeat(inputs, beam, axis=0),
                              targets.reshape(batch * beam, length))
  assert full.dtype == jnp.float32
  full = np.asarray(full).reshape(batch, beam, length, VOCAB)

  @jax.jit
  def cached(params):
    cache = model.apply({'params': params}, inputs, method=lambda m, x: m.init_decode_cache(
        m.encode(x), x, beam, length))
    decoder_inputs = np.pad(targets, ((0, 0), (0, 0), (1, 0)))
    steps = []
    for t in range(length):
      logits, cache = model.apply({'params': params}, decoder_inputs[:, :, t], t, cache,
                                  method='decode_step')
      steps.append(logits)
    return jnp.stack(steps, axis=2)

  logits = cached(params)
  assert logits.dtype == jnp.float32
  spread = np.std(full)
  # bf16 rounds at ~4e-3 relative; cached and full passes round differently.
  difference = np.max(np.abs(np.asarray(logits) - full))
  assert difference < 0.05 * spread, (difference, spread)
  full32 = Transformer(config(pre_norm=True)).apply(
      {'params': params}, np.repeat(inputs, beam, axis=0), targets.reshape(batch * beam, length))
  assert np.max(np.abs(np.asarray(full32).reshape(full.shape) - full)) > 1e-4  # Really bf16.


def reversal_batch(rng: np.random.Generator, size: int, max_len: int = 8):
  """Random sources of 3..max_len real tokens; targets: the source reversed, then EOS."""
  lengths = rng.integers(3, max_len + 1, size=size)
  tokens = rng.integers(3, VOCAB, size=(size, max_len)).astype(np.int32)
  inputs = np.where(np.arange(max_len) < lengths[:, None], tokens, 0).astype(np.int32)
  targets = np.zeros((size, max_len + 1), np.int32)
  for i, n in enumerate(lengths):
    targets[i, :n] = inputs[i, :n][::-1]
    targets[i, n] = EOS_ID
  return inputs, targets


@functools.cache
def trained_params(steps: int):
  """A float32 model trained with Adam to reverse sequences; cached per step count."""
  model = Transformer(config())
  rng = np.random.default_rng(1)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(1), dummy, dummy)['params']
  optimizer = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 30, steps))
  state = optimizer.init(params)

  @jax.jit
  def train_step(params, state, inputs, targets):
    def loss_fn(params):
      logits = model.apply({'params': params}, inputs, targets)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return jnp.sum(loss * (targets > 0)) / jnp.sum(targets > 0)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for _ in range(steps):
    params, state, loss = train_step(params, state, *reversal_batch(rng, 64))
  return params, float(loss)


def compare_bf16_with_float32(steps: int, sentences: int, min_correct: float,
                              min_agreement: float):
  params, loss = trained_params(steps)
  inputs, targets = reversal_batch(np.random.default_rng(2), sentences)
  outputs = {}
  for dtype in ('float32', 'bfloat16'):
    model = Transformer(config(dtype=dtype))
    search = jax.jit(functools.partial(transformer_beam_search, model, beam_size=4,
                                       max_length=targets.shape[1]))
    outputs[dtype] = np.asarray(search(params, inputs)[0][:, 0])
  correct = np.mean(np.all(outputs['float32'] == targets, axis=1))
  agree = np.all(outputs['float32'] == outputs['bfloat16'], axis=1)
  print(f'{steps} Adam steps, final loss {loss:.3f}: float32 beam search reverses '
        f'{correct:.0%} of {sentences}; bf16 gives the same translation for {agree.sum()} '
        f'of {sentences}')
  assert correct >= min_correct  # The model has learned the task.
  assert agree.mean() >= min_agreement


def test_bfloat16_beam_search_on_a_trained_model_matches_float32():
  compare_bf16_with_float32(steps=300, sentences=64, min_correct=0.5, min_agreement=0.9)


@pytest.mark.slow
def test_bfloat16_beam_search_on_a_longer_trained_model_matches_float32():
  compare_bf16_with_float32(steps=1500, sentences=256, min_correct=0.9, min_agreement=0.95)
