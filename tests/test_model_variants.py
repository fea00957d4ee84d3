"""Tests of the `cpu_tuned` switch and of the model's library surface: both settings share
parameters and results (values, gradients, forward-mode derivatives, cached decoding);
configs from JSON; positions from packed segments; the upgrade of old parameter trees; the
layer classes on their own."""

import dataclasses
import functools
import json

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import (
  Decoder,
  DecoderLayer,
  Encoder,
  EncoderLayer,
  FeedForward,
  MultiHeadAttention,
  Transformer,
  TransformerConfig,
  backend,
  masks,
)
from nmt.legacy import upgrade_params

VOCAB = 41


def tiny_config(**overrides) -> TransformerConfig:
  settings = dict(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=2,
                  num_decoder_layers=2, dropout_rate=0.0, max_len=24)
  return TransformerConfig(**{**settings, **overrides})


@functools.cache
def init_params(config: TransformerConfig, seed: int = 0):
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(Transformer(config).init)(jax.random.key(seed), dummy, dummy)['params']
  # LayerNorm scales and biases away from 1 / 0, so that they matter.
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.2 * rng.standard_normal(x.shape).astype(np.float32)
      if path[-1].key in ('scale', 'bias') else x, params)


def batch(seed=0, shape=(3, 7)):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, VOCAB, size=shape).astype(np.int32)
  targets = rng.integers(3, VOCAB, size=(shape[0], shape[1] - 1)).astype(np.int32)
  inputs[1, 5:], targets[1, 3:] = 0, 0  # Padding.
  return inputs, targets


def max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def loss_fn(model, params, inputs, targets):
  logits = model.apply({'params': params}, inputs, targets)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * (targets > 0)) / jnp.sum(targets > 0)


# The fast set checks the paper's post-LN; pre-LN runs with -m slow.
@pytest.mark.parametrize('pre_norm', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cpu_tuned_and_default_share_parameters_logits_and_gradients(pre_norm):
  cpu, default = (tiny_config(pre_norm=pre_norm, cpu_tuned=flag) for flag in (True, False))
  dummy = jnp.ones((1, 4), jnp.int32)
  shapes = [jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), jax.eval_shape(
      Transformer(c).init, jax.random.key(0), dummy, dummy)) for c in (cpu, default)]
  assert shapes[0] == shapes[1]
  params = init_params(cpu)
  inputs, targets = batch(1)
  logits = [jax.jit(Transformer(c).apply)({'params': params}, inputs, targets)
            for c in (cpu, default)]
  assert max_abs(*logits) < 1e-5 and np.std(np.asarray(logits[0])) > 0.1
  grads = [jax.jit(jax.grad(functools.partial(loss_fn, Transformer(c))))(params, inputs, targets)
           for c in (cpu, default)]
  for (path, g_cpu), g_default in zip(jax.tree_util.tree_flatten_with_path(grads[0])[0],
                                      jax.tree_util.tree_leaves(grads[1]), strict=True):
    scale = float(np.max(np.abs(np.asarray(g_default)))) + 1e-6
    assert max_abs(g_cpu, g_default) < 1e-4 * max(scale, 1.0), jax.tree_util.keystr(path)
  # The switch really switches: the CPU variant traces its own LayerNorm.
  jaxpr = str(jax.make_jaxpr(lambda p: Transformer(cpu).apply({'params': p}, inputs, targets))(
      params))
  assert 'name=layer_norm' in jaxpr
  jaxpr = str(jax.make_jaxpr(lambda p: Transformer(default).apply(
      {'params': p}, inputs, targets))(params))
  assert 'name=layer_norm' not in jaxpr


def test_dropout_variants_drop_at_the_rate():
  for flag in (True, False):
    config = tiny_config(cpu_tuned=flag, dropout_rate=0.3)
    params = init_params(tiny_config())
    inputs, targets = batch(2)
    forward = jax.jit(lambda key, config=config: Transformer(config).apply(
        {'params': params}, inputs, targets, train=True, rngs={'dropout': key}))
    apply = lambda seed, forward=forward: forward(jax.random.key(seed))
    first, again, other = apply(0), apply(0), apply(1)
    assert max_abs(first, again) == 0.0 and max_abs(first, other) > 1e-3
    layer = backend.dropout(config, 0.3)
    out = np.asarray(layer.apply({}, jnp.ones((64, 64)), deterministic=False,
                                 rngs={'dropout': jax.random.key(0)}))
    assert 0.65 < (out != 0).mean() < 0.75
    np.testing.assert_allclose(out[out != 0], 1 / 0.7, rtol=1e-6)


@pytest.mark.parametrize('pre_norm', [False, True])
def test_layer_drop_skips_whole_layers_in_training_only(pre_norm):
  plain = tiny_config(pre_norm=pre_norm)
  params = init_params(plain)
  inputs, targets = batch(3)
  other_inputs = np.where(inputs > 0, (inputs + 5) % VOCAB + (inputs + 5 >= VOCAB) * 3, 0)

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def logits(config, inputs, key, train):
    return Transformer(config).apply({'params': params}, inputs, targets, train=train,
                                     rngs={'dropout': key})

  def forward(config, inputs, seed, train=True):
    return np.asarray(logits(config, inputs, jax.random.key(seed), train))

  full = forward(plain, inputs, 0)
  half = tiny_config(pre_norm=pre_norm, layer_drop_rate=0.5)
  # Inference runs every layer.
  np.testing.assert_allclose(forward(half, inputs, 0, train=False), full, rtol=1e-5, atol=1e-5)
  # Training: each of the 4 layers is kept or skipped; over 40 draws some keep all of them
  # (the plain model's logits) and some do not.
  draws = [forward(half, inputs, seed) for seed in range(40)]
  kept_all = [max_abs(d, full) < 1e-5 for d in draws]
  assert 0 < sum(kept_all) < len(draws)
  # Skipping every layer leaves the decoder without the source: a changed source changes
  # no logit, while with the layers it changes them.
  almost_all = tiny_config(pre_norm=pre_norm, layer_drop_rate=1 - 1e-7)
  assert max_abs(forward(almost_all, inputs, 1), forward(almost_all, other_inputs, 1)) == 0.0
  assert max_abs(forward(plain, inputs, 1), forward(plain, other_inputs, 1)) > 1e-3
  with pytest.raises(ValueError, match='layer_drop_rate'):
    tiny_config(layer_drop_rate=1.0)


@pytest.mark.parametrize('cpu_tuned', [True, pytest.param(False, marks=pytest.mark.slow)])
def test_forward_mode_derivatives_match_the_plain_layer_norm_model(cpu_tuned):
  """jax.jvp and jax.jacfwd through the whole model, against cpu_tuned=False (nn.LayerNorm)."""
  layers = dict(num_encoder_layers=1, num_decoder_layers=1, pre_norm=True)
  config = tiny_config(cpu_tuned=cpu_tuned, **layers)
  reference = Transformer(tiny_config(cpu_tuned=False, **layers))
  model = Transformer(config)
  params = init_params(config)
  inputs, targets = batch(3)

  def logits_of(model, params):
    return model.apply({'params': params}, inputs, targets)

  tangent = jax.tree_util.tree_map(
      lambda x: jnp.asarray(np.random.default_rng(x.size).standard_normal(x.shape),
                            jnp.float32), params)
  jvp = jax.jit(lambda model, p, t: jax.jvp(functools.partial(logits_of, model), (p,), (t,)),
                static_argnums=0)
  value, derivative = jvp(model, params, tangent)
  value_ref, derivative_ref = jvp(reference, params, tangent)
  assert max_abs(value, value_ref) < 1e-5
  assert np.std(np.asarray(derivative_ref)) > 0.1
  assert max_abs(derivative, derivative_ref) < 1e-4 * np.abs(np.asarray(derivative_ref)).max()

  # Jacobian of the loss w.r.t. a LayerNorm scale and the embedding of a few tokens.
  def loss_of(model, scale, rows):
    p = jax.tree_util.tree_map(lambda x: x, params)
    p['decoder']['layers_0']['feed_forward_sublayer']['norm']['scale'] = scale
    p['embed']['embedding'] = p['embed']['embedding'].at[3:6].set(rows)
    return jnp.stack([loss_fn(model, p, inputs, targets),
                      jnp.sum(model.apply({'params': p}, inputs, targets)[:, 0, :5])])

  args = (params['decoder']['layers_0']['feed_forward_sublayer']['norm']['scale'],
          params['embed']['embedding'][3:6])
  jac = jax.jit(jax.jacfwd(functools.partial(loss_of, model), argnums=(0, 1)))(*args)
  jac_ref = jax.jit(jax.jacfwd(functools.partial(loss_of, reference), argnums=(0, 1)))(*args)
  jac_rev = jax.jit(jax.jacrev(functools.partial(loss_of, model), argnums=(0, 1)))(*args)
  for got, rev, want in zip(jac, jac_rev, jac_ref, strict=True):
    assert np.abs(np.asarray(want)).max() > 1e-3
    tolerance = 1e-4 * np.abs(np.asarray(want)).max()
    assert max_abs(got, want) < tolerance and max_abs(rev, want) < tolerance


def test_config_from_json_with_dtype_names():
  fields = dict(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                num_decoder_layers=1, dropout_rate=0.1, attention_dropout_rate=0.0,
                layer_drop_rate=0.0, max_len=24, share_embeddings=True, pre_norm=True,
                norm='scale', fix_norm=True, positional='sinusoidal',
                activation='relu', attention_probs='softmax', attention_score='scaled_dot',
                linear_attention=False, layer_norm_epsilon=1e-6,
                dtype='bfloat16', param_dtype='float32', cpu_tuned=None,
                attention_implementation=None, output_vocab_size=0)
  assert set(fields) == {f.name for f in dataclasses.fields(TransformerConfig)}
  config = TransformerConfig(**json.loads(json.dumps(fields)))
  assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.float32
  assert config == TransformerConfig(**{**fields, 'dtype': jnp.bfloat16,
                                        'param_dtype': jnp.float32})
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(Transformer(config).init, jax.random.key(0), dummy, dummy)
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype('float32')}
  with pytest.raises(TypeError):
    TransformerConfig(**{**fields, 'dtype': 'no_such_dtype'})


def test_attention_implementation_is_passed_through(monkeypatch):
  seen = []
  original = jax.nn.dot_product_attention

  def spy(*args, implementation=None, **kwargs):
    seen.append(implementation)
    return original(*args, implementation=implementation, **kwargs)

  params = init_params(tiny_config())  # Before the spy: initializing calls the default too.
  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  config = tiny_config(attention_implementation='xla')
  inputs, targets = batch(4)
  logits = Transformer(config).apply({'params': params}, inputs, targets)
  assert seen and set(seen) == {'xla'}
  reference = Transformer(tiny_config()).apply({'params': init_params(tiny_config())}, inputs,
                                               targets)
  assert max_abs(logits, reference) < 1e-6


def test_positions_derived_from_segmentation_equal_explicit_ones():
  config = tiny_config()
  params = init_params(config)
  model = Transformer(config)
  rng = np.random.default_rng(5)
  # Two rows, packed: segments of lengths (3, 4, 2) + 1 pad and (5, 3) + 2 pads; targets likewise.
  def pack(lengths, total):
    tokens, segmentation, positions = (np.zeros(total, np.int32) for _ in range(3))
    start = 0
    for segment, n in enumerate(lengths, start=1):
      tokens[start:start + n] = rng.integers(3, VOCAB, size=n)
      segmentation[start:start + n] = segment
      positions[start:start + n] = np.arange(n)
      start += n
    return tokens, segmentation, positions

  src = [pack([3, 4, 2], 10), pack([5, 3], 10)]
  tgt = [pack([2, 5, 1], 9), pack([4, 4], 9)]
  (inputs, inputs_seg, inputs_pos), (targets, targets_seg, targets_pos) = (
      [np.stack(a) for a in zip(*side, strict=True)] for side in (src, tgt))
  derived = np.asarray(masks.positions_from_segmentation(jnp.asarray(inputs_seg)))
  real = inputs_seg > 0
  np.testing.assert_array_equal(derived[real], inputs_pos[real])
  packed = dict(inputs_segmentation=inputs_seg, targets_segmentation=targets_seg)
  explicit = model.apply({'params': params}, inputs, targets, **packed,
                         inputs_positions=inputs_pos, targets_positions=targets_pos)
  implicit = model.apply({'params': params}, inputs, targets, **packed)
  real_targets = targets > 0
  assert max_abs(np.asarray(explicit)[real_targets], np.asarray(implicit)[real_targets]) < 1e-6
  # Positions along the whole row would differ: the check can fail.
  row_positions = model.apply({'params': params}, inputs, targets, **packed,
                              inputs_positions=np.broadcast_to(np.arange(10), inputs.shape),
                              targets_positions=np.broadcast_to(np.arange(9), targets.shape))
  assert max_abs(np.asarray(row_positions)[real_targets],
                 np.asarray(explicit)[real_targets]) > 1e-3


def old_layout(params):
  """Today's tree in the earlier layout: layers and final norms at the top level."""
  old = {k: v for k, v in params.items() if k not in ('encoder', 'decoder')}
  for side in ('encoder', 'decoder'):
    for name, value in params[side].items():
      old[f'{side}_{name}'] = value  # 'layers_0' -> 'encoder_layers_0', 'norm' -> 'encoder_norm'.
  return old


@pytest.mark.parametrize('pre_norm', [False, True])
def test_upgrade_params_maps_the_old_layout(pre_norm):
  config = tiny_config(pre_norm=pre_norm)
  params = init_params(config)
  old = old_layout(params)
  expected = {'embed', 'encoder_layers_0', 'encoder_layers_1', 'decoder_layers_0',
              'decoder_layers_1'} | ({'encoder_norm', 'decoder_norm'} if pre_norm else set())
  assert set(old) == expected
  upgraded = upgrade_params(old)
  assert jax.tree_util.tree_structure(upgraded) == jax.tree_util.tree_structure(params)
  inputs, targets = batch(6)
  model = Transformer(config)
  np.testing.assert_array_equal(np.asarray(model.apply({'params': upgraded}, inputs, targets)),
                                np.asarray(model.apply({'params': params}, inputs, targets)))
  assert upgrade_params(params) is params
  with pytest.raises(flax.errors.ScopeParamNotFoundError):  # The old layout does not apply.
    model.apply({'params': old}, inputs, targets)


def test_layer_classes_compose_on_their_own():
  """Encoder and Decoder used directly, outside the Transformer, on embedded inputs."""
  config = tiny_config(pre_norm=True)
  rng = jax.random.key(7)
  x = jax.random.normal(rng, (2, 5, config.d_model))
  y = jax.random.normal(jax.random.key(8), (2, 4, config.d_model))
  mask = jnp.ones((2, 1, 5, 5), bool)
  encoder = Encoder(config)
  enc_params = encoder.init(rng, x, mask)
  encoded = encoder.apply(enc_params, x, mask)
  assert encoded.shape == x.shape
  causal = jnp.tril(jnp.ones((4, 4), bool))[None, None]
  decoder = Decoder(config)
  dec_params = decoder.init(rng, y, encoded, causal, jnp.ones((2, 1, 4, 5), bool))
  out = decoder.apply(dec_params, y, encoded, causal, jnp.ones((2, 1, 4, 5), bool))
  assert out.shape == y.shape and np.all(np.isfinite(np.asarray(out)))
  assert set(dec_params['params']) == {'layers_0', 'layers_1', 'norm'}
  for cls, args in [(EncoderLayer, (x, mask, False)), (FeedForward, (x,)),
                    (MultiHeadAttention, (x, x, mask, False)),
                    (DecoderLayer, (y, encoded, causal, jnp.ones((2, 1, 4, 5), bool), False))]:
    module = cls(config)
    variables = module.init(rng, *args)
    assert module.apply(variables, *args).shape == args[0].shape
  assert isinstance(Encoder(config), nn.Module)
