"""Tests of model/transformer.py: shapes and counts, masking, packing, cached decoding, and
logit parity with an independent PyTorch implementation built from torch.nn layers."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from model import (
  Transformer,
  TransformerConfig,
  count_params,
  sinusoidal_table,
  transformer_beam_search,
)
from model import config as config_lib
from model.cpu import dropout as cpu_dropout
from model.cpu import layer_norm as cpu_layer_norm
from model.transformer import ScaleNorm

VOCAB = 53


def small_config(**overrides) -> TransformerConfig:
  settings = dict(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                  num_decoder_layers=2, dropout_rate=0.1, max_len=32)
  return TransformerConfig(**{**settings, **overrides})


def random_tokens(rng: np.random.Generator, shape, vocab: int = VOCAB) -> np.ndarray:
  """Real token ids only (never pad/EOS/UNK), so every position is a real position."""
  return rng.integers(3, vocab, size=shape).astype(np.int32)


# Compilation dominates the run time on CPU: share parameters and jitted functions per config
# (configs are frozen, hence hashable) and reuse a few array shapes.
@functools.cache
def init_params(config: TransformerConfig, seed: int = 0):
  dummy = jnp.ones((1, 4), jnp.int32)
  return jax.jit(Transformer(config).init)(jax.random.key(seed), dummy, dummy)['params']


@functools.cache
def make_forward(config: TransformerConfig):
  """Jitted teacher-forced forward pass: (params, inputs, targets, **kw) -> logits."""
  model = Transformer(config)

  @functools.partial(jax.jit, static_argnames='train')
  def jitted(params, inputs, targets, dropout_key, train, **kwargs):
    return model.apply({'params': params}, inputs, targets, train=train,
                       rngs={'dropout': dropout_key}, **kwargs)

  def forward(params, inputs, targets, train=False, dropout_seed=0, **kwargs):
    # The key is always an argument, so a new seed does not retrace. 'rbg' keys compile much
    # faster than threefry on CPU.
    key = jax.random.key(dropout_seed, impl='rbg')
    return jitted(params, inputs, targets, key, train=train, **kwargs)

  return forward


def max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------------------------
# 1. Parameter counts.


def expected_param_count(c: TransformerConfig) -> int:
  """The architecture's parameter count written out by hand."""
  d, f, v = c.d_model, c.d_ff, c.vocab_size
  # Q, K, V and output projections; biases on all but K (softmax cancels a key bias).
  attention = 4 * d * d + 3 * d
  ffn = d * f + f + f * d + d
  layer_norm = 2 * d  # Scale and bias.
  encoder_layer = attention + ffn + 2 * layer_norm
  decoder_layer = 2 * attention + ffn + 3 * layer_norm
  # Shared: one [vocab, d] matrix. Separate: source, target, and a bias-free output projection.
  embeddings = v * d if c.share_embeddings else 3 * v * d
  final_norms = 2 * layer_norm if c.pre_norm else 0  # Post-LN already ends on a LayerNorm.
  return (embeddings + c.num_encoder_layers * encoder_layer
          + c.num_decoder_layers * decoder_layer + final_norms)


def abstract_param_count(config: TransformerConfig) -> int:
  dummy = jnp.ones((1, 4), jnp.int32)
  # eval_shape: only shapes, so the 200M-parameter big model is never allocated.
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), dummy, dummy)
  return count_params(shapes['params'])


# The paper reports 65M (base) and 213M (big) for its 37000-token shared vocabulary.
PARAM_COUNTS = {  # (size, share_embeddings, pre_norm) -> parameters with a 37000-token vocab.
    ('base', True, False): 63_073_280,
    ('base', True, True): 63_075_328,
    ('base', False, False): 100_961_280,
    ('base', False, True): 100_963_328,
    ('big', True, False): 214_226_944,
    ('big', True, True): 214_231_040,
    ('big', False, False): 290_002_944,
    ('big', False, True): 290_007_040,
}


@pytest.mark.parametrize('size, share_embeddings, pre_norm', list(PARAM_COUNTS))
def test_param_count(size, share_embeddings, pre_norm):
  config = getattr(TransformerConfig, size)(
      37000, share_embeddings=share_embeddings, pre_norm=pre_norm)
  count = abstract_param_count(config)
  print(f'{size} share_embeddings={share_embeddings} pre_norm={pre_norm}: {count:,} params')
  assert count == expected_param_count(config)
  assert count == PARAM_COUNTS[size, share_embeddings, pre_norm]
  if share_embeddings and not pre_norm:
    paper = {'base': 65e6, 'big': 213e6}[size]
    assert abs(count - paper) / paper < 0.05


# --------------------------------------------------------------------------------------------
# 2.-4. Causality, padding, packing.


# Most tests use these shapes so that their jitted forward passes are compiled once.
SRC, TGT = (2, 7), (2, 6)


def test_causality():
  config = small_config()
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(1)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  base = np.asarray(forward(params, inputs, targets))
  for j in (0, 2, 4):
    changed = targets.copy()
    changed[:, j] = 3 + (changed[:, j] - 3 + 11) % (VOCAB - 3)  # A different real token.
    logits = np.asarray(forward(params, inputs, changed))
    # Target j is decoder input j + 1: positions <= j never see it, later ones do.
    assert max_abs(logits[:, :j + 1], base[:, :j + 1]) < 1e-5
    assert max_abs(logits[:, j + 1:], base[:, j + 1:]) > 1e-3


def test_padding_invariance():
  config = small_config()
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(2)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  base = np.asarray(forward(params, inputs, targets))
  # Trailing padding on sources and targets; row 1 is also shorter (source 3, target 2).
  padded_inputs = np.pad(inputs, ((0, 0), (0, 4)))
  padded_targets = np.pad(targets, ((0, 0), (0, 3)))
  padded_inputs[1, 3:], padded_targets[1, 2:] = 0, 0
  batched = np.asarray(forward(params, padded_inputs, padded_targets))
  assert batched.shape == (2, 9, VOCAB)
  assert max_abs(batched[0, :6], base[0]) < 1e-5
  # Row 1 equals itself run alone, unpadded.
  alone = forward(params, inputs[1:, :3], targets[1:, :2])
  assert max_abs(batched[1, :2], alone[0]) < 1e-5
  # The check can fail: a padded source position that is not masked changes the logits.
  unmasked = padded_inputs.copy()
  unmasked[1, 3:] = 5
  assert max_abs(forward(params, unmasked, padded_targets)[1, :2], batched[1, :2]) > 1e-3


def test_packing_matches_separate_examples():
  config = small_config()
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(3)
  src = [random_tokens(rng, (4,)), random_tokens(rng, (5,))]
  tgt = [random_tokens(rng, (3,)), random_tokens(rng, (4,))]

  def pack(parts, total):
    """One row: the parts back to back, segment ids 1, 2, ..., positions restarting, pads."""
    tokens, segmentation, positions = (np.zeros(total, np.int32) for _ in range(3))
    start = 0
    for segment, part in enumerate(parts, start=1):
      tokens[start:start + len(part)] = part
      segmentation[start:start + len(part)] = segment
      positions[start:start + len(part)] = np.arange(len(part))
      start += len(part)
    return tokens, segmentation, positions

  # Row 0: both pairs packed (two trailing pads); rows 1 and 2: each pair alone (padding
  # invariance is tested above, so the same shapes are reused for one compilation).
  rows = [(pack(src, 11), pack(tgt, 9)), (pack(src[:1], 11), pack(tgt[:1], 9)),
          (pack(src[1:], 11), pack(tgt[1:], 9))]
  (inputs, inputs_seg, inputs_pos), (targets, targets_seg, targets_pos) = (
      [np.stack(arrays) for arrays in zip(*side, strict=True)] for side in zip(*rows, strict=True))
  kwargs = dict(inputs_positions=inputs_pos, targets_positions=targets_pos)
  logits = np.asarray(forward(params, inputs, targets, inputs_segmentation=inputs_seg,
                              targets_segmentation=targets_seg, **kwargs))
  assert max_abs(logits[0, :3], logits[1, :3]) < 1e-5
  assert max_abs(logits[0, 3:7], logits[2, :4]) < 1e-5
  # Unsegmented (all one segment) the second pair sees the first: the comparison can fail.
  one_segment = lambda tokens: (tokens > 0).astype(np.int32)
  unsegmented = np.asarray(forward(params, inputs, targets, **kwargs,
                                   inputs_segmentation=one_segment(inputs),
                                   targets_segmentation=one_segment(targets)))
  assert max_abs(unsegmented[0, 3:7], logits[2, :4]) > 1e-3


# --------------------------------------------------------------------------------------------
# 5. Incremental decoding.


@functools.cache
def decoding_functions(config: TransformerConfig):
  """Jitted (encode + init_decode_cache) and decode_step for a config."""
  model = Transformer(config)

  @functools.partial(jax.jit, static_argnums=(2, 3))
  def start(params, inputs, beam_size, max_length):
    encoded = model.apply({'params': params}, inputs, method='encode')
    return model.apply({'params': params}, encoded, inputs, beam_size, max_length,
                       method='init_decode_cache')

  @jax.jit
  def step(params, tokens, step, cache):
    return model.apply({'params': params}, tokens, step, cache, method='decode_step')

  return start, step


class CachedDecoder:
  """Runs the model's cached decoding for given per-step tokens (and, CPU-tuned, slots)."""

  def __init__(self, config, params, inputs, beam_size, max_length):
    self.params = params
    start, self._step = decoding_functions(config)
    self.cache = start(params, inputs, beam_size, max_length)

  def step(self, tokens, step, cache_slots=None):
    if cache_slots is not None:  # The CPU-tuned cache's ancestry index.
      self.cache = {**self.cache, 'slots': cache_slots}
    logits, self.cache = self._step(self.params, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(step, jnp.int32), self.cache)
    return np.asarray(logits)


@pytest.mark.parametrize('cpu_tuned', [True, False])
def test_cached_decoding_matches_forward_greedy(cpu_tuned):
  config = small_config(cpu_tuned=cpu_tuned)
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(4)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  inputs[1, 4:] = 0  # A padded source.
  full = np.asarray(forward(params, inputs, targets))
  decoder = CachedDecoder(config, params, inputs, beam_size=1, max_length=8)
  decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))  # Start symbol 0, then the targets.
  for t in range(targets.shape[1]):
    logits = decoder.step(decoder_inputs[:, t:t + 1], t)
    assert logits.shape == (2, 1, VOCAB)
    assert max_abs(logits[:, 0], full[:, t]) < 1e-4, f'step {t}'


@pytest.mark.parametrize('cpu_tuned, norm, fix_norm', [
    (True, 'layer', False), (False, 'layer', False), (True, 'scale', False), (True, 'scale', True)])
def test_cached_decoding_matches_forward_beams(cpu_tuned, norm, fix_norm):
  # Pre-LN here (post-LN above), so both variants' decoding paths (final norm) are covered.
  config = small_config(pre_norm=True, cpu_tuned=cpu_tuned, norm=norm, fix_norm=fix_norm)
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(5)
  batch, beam, length = 2, 3, 6
  inputs = random_tokens(rng, (batch, 7))
  inputs[0, 5:] = 0
  targets = random_tokens(rng, (batch, beam, length))  # A different prefix in every slot.
  flat_targets = targets.reshape(batch * beam, length)
  full = np.asarray(forward(params, np.repeat(inputs, beam, axis=0), flat_targets))
  full = full.reshape(batch, beam, length, VOCAB)
  decoder = CachedDecoder(config, params, inputs, beam_size=beam, max_length=length)
  decoder_inputs = np.pad(targets, ((0, 0), (0, 0), (1, 0)))
  for t in range(length):
    logits = decoder.step(decoder_inputs[:, :, t], t)
    assert max_abs(logits, full[:, :, t]) < 1e-4, f'step {t}'


def test_cached_decoding_with_cache_slots():
  """The CPU-tuned cache's reordering by `slots`: hypotheses whose ancestors sit in other
  slots."""
  config = small_config(cpu_tuned=True)
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(6)
  batch, beam, max_len = 2, 2, 5
  inputs = random_tokens(rng, (batch, 7))
  a, b = random_tokens(rng, (batch, 4)), random_tokens(rng, (batch, 4))
  decoder = CachedDecoder(config, params, inputs, beam_size=beam, max_length=max_len)

  def slots(*ancestors):
    """ancestors[q] = slots of hypothesis q's tokens at steps 0, 1, ...; the rest is unused."""
    table = np.zeros((batch, beam, max_len), np.int32)
    for q, row in enumerate(ancestors):
      table[:, q, :len(row)] = row
    return jnp.asarray(table)

  def reference(*sequences):
    """Full-forward logits at the last position of each slot's decoder input sequence."""
    decoder_inputs = np.stack([np.stack(s, axis=-1) for s in sequences], axis=1)
    steps = decoder_inputs.shape[-1]
    # Targets are the decoder inputs shifted left; padded to 6 (one compiled shape), the
    # positions after the last decoder input do not affect its logits (causality).
    targets = np.full((batch, beam, 6), 7, np.int32)
    targets[..., :steps - 1] = decoder_inputs[..., 1:]
    logits = forward(params, np.repeat(inputs, beam, axis=0), targets.reshape(batch * beam, 6))
    return np.asarray(logits).reshape(batch, beam, 6, VOCAB)[:, :, steps - 1]

  start = np.zeros((batch,), np.int32)
  # Steps 0-1: slot 0 decodes prefix A, slot 1 prefix B.
  decoder.step(np.stack([start, start], 1), 0)
  logits = decoder.step(np.stack([a[:, 0], b[:, 0]], 1), 1)
  assert max_abs(logits, reference([start, a[:, 0]], [start, b[:, 0]])) < 1e-4
  # Step 2: the hypotheses swap slots; slot 0 extends B (ancestors in slot 1) and vice versa.
  logits = decoder.step(np.stack([b[:, 1], a[:, 1]], 1), 2, slots([1, 1], [0, 0]))
  seq0 = [start, b[:, 0], b[:, 1]]
  seq1 = [start, a[:, 0], a[:, 1]]
  assert max_abs(logits, reference(seq0, seq1)) < 1e-4
  # Step 3: both slots extend the hypothesis in slot 0 (B's line) with different tokens, so
  # slot 1's ancestors are slots 1, 1, 0 and its own step-2 entry (A's line) is abandoned.
  logits = decoder.step(np.stack([b[:, 2], a[:, 2]], 1), 3, slots([1, 1, 0], [1, 1, 0]))
  seq0, seq1 = seq0 + [b[:, 2]], seq0 + [a[:, 2]]
  assert max_abs(logits, reference(seq0, seq1)) < 1e-4
  # Step 4: slot 0 continues slot 1's hypothesis; the lines differ only in their step-3 slot.
  logits = decoder.step(np.stack([a[:, 3], b[:, 3]], 1), 4, slots([1, 1, 0, 1], [1, 1, 0, 0]))
  expected = reference(seq1 + [a[:, 3]], seq0 + [b[:, 3]])
  assert max_abs(logits, expected) < 1e-4
  # The check can fail: the step-2 tokens without the swap in `cache_slots` mismatch the
  # implied swapped sequences.
  other = CachedDecoder(config, params, inputs, beam_size=beam, max_length=max_len)
  other.step(np.stack([start, start], 1), 0)
  other.step(np.stack([a[:, 0], b[:, 0]], 1), 1)
  unswapped = other.step(np.stack([b[:, 1], a[:, 1]], 1), 2, slots([0, 0], [1, 1]))
  swapped = reference([start, b[:, 0], b[:, 1]], [start, a[:, 0], a[:, 1]])
  assert max_abs(unswapped, swapped) > 1e-3


# --------------------------------------------------------------------------------------------
# 6.-7. Positional encodings and embedding scale.


def test_sinusoidal_table_formula():
  max_len, d = 50, 16
  table = sinusoidal_table(max_len, d)
  assert table.shape == (max_len, d) and table.dtype == np.float32
  for pos in (0, 1, 7, 49):
    for i in (0, 1, 3, 7):
      angle = pos / 10000 ** (2 * i / d)
      assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
      assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)
  # Interleaved, not [sin | cos] halves: column 1 is cos(pos), column d/2 is a sine.
  assert table[5, 1] == pytest.approx(math.cos(5.0), abs=1e-6)
  assert table[5, d // 2] == pytest.approx(math.sin(5 / 10000 ** (d // 2 / d)), abs=1e-6)


def test_embedding_scaled_by_sqrt_d_model():
  config = small_config()
  params = init_params(config)
  model = Transformer(config)
  inputs = random_tokens(np.random.default_rng(7), SRC)

  @jax.jit
  def first_layer_input(params, inputs):
    # Record the input of the first encoder layer: the embedded source.
    captured = {}

    def record(next_fun, args, kwargs, context):
      if context.method_name == '__call__' and context.module.name == 'layers_0':
        captured['x'] = args[0]
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      model.apply({'params': params}, inputs, method='encode')
    return captured['x']

  embedded = first_layer_input(params, inputs)
  table = np.asarray(params['embed']['embedding'])
  positions = sinusoidal_table(SRC[1], config.d_model)
  assert max_abs(embedded, table[inputs] * math.sqrt(config.d_model) + positions) < 1e-5
  assert max_abs(embedded, table[inputs] + positions) > 0.1  # Unscaled would fail.


# --------------------------------------------------------------------------------------------
# 8. Parity with PyTorch's reference layers.


def t(x) -> torch.Tensor:
  return torch.tensor(np.asarray(x, np.float32))


def copy_attention(torch_attention: torch.nn.MultiheadAttention, p, d: int):
  # Ours: q = x @ K.reshape(d, d) (head-major columns); torch: q = x @ W.T with W = [Wq; Wk; Wv].
  in_w = [np.asarray(p[n]['kernel']).reshape(d, d).T for n in ('query', 'key', 'value')]
  # The model has no key bias (softmax cancels it): torch's is set to zero.
  in_b = [np.asarray(p[n]['bias']).reshape(d) if 'bias' in p[n] else np.zeros(d, np.float32)
          for n in ('query', 'key', 'value')]
  torch_attention.in_proj_weight.copy_(t(np.concatenate(in_w, 0)))
  torch_attention.in_proj_bias.copy_(t(np.concatenate(in_b, 0)))
  # Ours: out kernel [heads, head_dim, d] flattens to W.T of torch's out_proj.
  torch_attention.out_proj.weight.copy_(t(np.asarray(p['out']['kernel']).reshape(d, d).T))
  torch_attention.out_proj.bias.copy_(t(p['out']['bias']))


def copy_norm(torch_norm: torch.nn.LayerNorm, p):
  torch_norm.weight.copy_(t(p['scale']))
  torch_norm.bias.copy_(t(p['bias']))


def copy_ffn(layer, p):
  layer.linear1.weight.copy_(t(np.asarray(p['hidden']['kernel']).T))
  layer.linear1.bias.copy_(t(p['hidden']['bias']))
  layer.linear2.weight.copy_(t(np.asarray(p['output']['kernel']).T))
  layer.linear2.bias.copy_(t(p['output']['bias']))


@torch.no_grad()
def torch_logits(config: TransformerConfig, params, inputs, targets) -> np.ndarray:
  """The same Transformer from torch.nn layers, with our weights copied in."""
  d = config.d_model
  kwargs = dict(d_model=d, nhead=config.num_heads, dim_feedforward=config.d_ff, dropout=0.0,
                activation='relu', layer_norm_eps=config.layer_norm_epsilon, batch_first=True,
                norm_first=config.pre_norm)
  encoder_layers, decoder_layers = [], []
  for i in range(config.num_encoder_layers):
    layer = torch.nn.TransformerEncoderLayer(**kwargs).eval()
    p = params['encoder'][f'layers_{i}']
    copy_attention(layer.self_attn, p['self_attention'], d)
    copy_ffn(layer, p['feed_forward'])
    copy_norm(layer.norm1, p['self_attention_sublayer']['norm'])
    copy_norm(layer.norm2, p['feed_forward_sublayer']['norm'])
    encoder_layers.append(layer)
  for i in range(config.num_decoder_layers):
    layer = torch.nn.TransformerDecoderLayer(**kwargs).eval()
    p = params['decoder'][f'layers_{i}']
    copy_attention(layer.self_attn, p['self_attention'], d)
    copy_attention(layer.multihead_attn, p['cross_attention'], d)
    copy_ffn(layer, p['feed_forward'])
    copy_norm(layer.norm1, p['self_attention_sublayer']['norm'])
    copy_norm(layer.norm2, p['cross_attention_sublayer']['norm'])
    copy_norm(layer.norm3, p['feed_forward_sublayer']['norm'])
    decoder_layers.append(layer)

  embedding = t(params['embed']['embedding'])
  inputs, targets = torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
  decoder_inputs = torch.nn.functional.pad(targets, (1, 0))[:, :-1]
  table = t(sinusoidal_table(config.max_len, d))

  def embed(tokens):
    return embedding[tokens] * math.sqrt(d) + table[:tokens.shape[1]]

  source_pad, target_pad = inputs == 0, targets == 0  # True = ignore this key.
  length = targets.shape[1]
  causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)

  x = embed(inputs)
  for layer in encoder_layers:
    x = layer(x, src_key_padding_mask=source_pad)
  if config.pre_norm:
    final = torch.nn.LayerNorm(d, eps=config.layer_norm_epsilon)
    copy_norm(final, params['encoder']['norm'])
    x = final(x)
  y = embed(decoder_inputs)
  for layer in decoder_layers:
    y = layer(y, x, tgt_mask=causal, tgt_key_padding_mask=target_pad,
              memory_key_padding_mask=source_pad)
  if config.pre_norm:
    final = torch.nn.LayerNorm(d, eps=config.layer_norm_epsilon)
    copy_norm(final, params['decoder']['norm'])
    y = final(y)
  return (y @ embedding.T).numpy()  # Tied output projection.


@pytest.mark.parametrize('pre_norm', [False, True])
def test_parity_with_torch(pre_norm):
  config = small_config(pre_norm=pre_norm)
  params, forward = init_params(config), make_forward(config)
  # Perturb the LayerNorm and bias parameters away from their 1/0 init so copying them matters.
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  rng = np.random.default_rng(8)
  perturbed = []
  for path, leaf in leaves:
    if path[-1].key in ('bias', 'scale'):
      leaf = leaf + 0.1 * rng.standard_normal(leaf.shape).astype(np.float32)
    perturbed.append(leaf)
  params = jax.tree_util.tree_unflatten(treedef, perturbed)

  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  ours = np.asarray(forward(params, inputs, targets))
  theirs = torch_logits(config, params, inputs, targets)
  assert max_abs(ours, theirs) < 1e-4
  assert np.std(ours) > 0.1  # Not trivially close.

  # Padded sources and targets (row 1): compare the real target positions only.
  inputs[1, 4:], targets[1, 3:] = 0, 0
  ours = np.asarray(forward(params, inputs, targets))
  theirs = torch_logits(config, params, inputs, targets)
  assert max_abs(ours[0], theirs[0]) < 1e-4
  assert max_abs(ours[1, :3], theirs[1, :3]) < 1e-4


# --------------------------------------------------------------------------------------------
# 9. jit, grad, bfloat16.


def test_jit_and_grad():
  config = small_config()
  params = init_params(config)
  model = Transformer(config)
  rng = np.random.default_rng(9)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  targets[1, 3:] = 0

  def loss_fn(p):
    logits = model.apply({'params': p}, inputs, targets, train=True,
                         rngs={'dropout': jax.random.key(1, impl='rbg')})
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    weights = targets > 0
    return jnp.sum(nll * weights) / jnp.sum(weights)

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert np.isfinite(float(loss)) and float(loss) > 0
  for path, grad in jax.tree_util.tree_flatten_with_path(grads)[0]:
    name = jax.tree_util.keystr(path)
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad)), name
    assert np.max(np.abs(grad)) > 1e-6, name


def test_bfloat16_compute():
  config32 = small_config()
  config16 = small_config(dtype=jnp.bfloat16)
  params = init_params(config32)
  dummy = jnp.ones((1, 4), jnp.int32)
  params16 = jax.eval_shape(Transformer(config16).init, jax.random.key(0), dummy, dummy)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params16))
  rng = np.random.default_rng(10)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  inputs[1, 5:], targets[1, 4:] = 0, 0
  logits32 = np.asarray(make_forward(config32)(params, inputs, targets))
  logits16 = make_forward(config16)(params, inputs, targets)
  assert logits16.dtype == jnp.float32
  logits16 = np.asarray(logits16)
  assert np.all(np.isfinite(logits16))
  difference = max_abs(logits16, logits32)
  # bf16 has an 8-bit mantissa (relative rounding ~4e-3); allow ~10% of the logit spread.
  assert difference < 0.1 * np.std(logits32)
  assert difference > 1e-6  # The bf16 model really computes in bf16.


# --------------------------------------------------------------------------------------------
# 10. Attention dropout and the explicit (non-fused) attention path.


def test_attention_dropout():
  config = small_config(dropout_rate=0.0, attention_dropout_rate=0.3)
  params, forward = init_params(config), make_forward(config)
  rng = np.random.default_rng(11)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  inputs[1, 4:] = 0
  first = np.asarray(forward(params, inputs, targets, train=True, dropout_seed=0))
  again = np.asarray(forward(params, inputs, targets, train=True, dropout_seed=0))
  other = np.asarray(forward(params, inputs, targets, train=True, dropout_seed=1))
  assert np.all(np.isfinite(first))
  assert max_abs(first, again) == 0.0
  assert max_abs(first, other) > 1e-3
  # train=False ignores attention dropout: the dropout-free model's logits, for any rng.
  eval_logits = np.asarray(forward(params, inputs, targets, dropout_seed=0))
  assert max_abs(eval_logits, forward(params, inputs, targets, dropout_seed=1)) == 0.0
  reference = make_forward(small_config())(params, inputs, targets)
  assert max_abs(eval_logits, reference) < 1e-5
  assert max_abs(first, reference) > 1e-3


def test_explicit_attention_path_matches_fused(monkeypatch):
  # A non-'softmax' key takes the einsum path (the one attention dropout uses); registered as
  # plain softmax it must reproduce the fused jax.nn.dot_product_attention path.
  calls = []

  def explicit_softmax(logits):
    calls.append(logits.shape)  # Proves this path is traced.
    return jax.nn.softmax(logits)

  monkeypatch.setitem(config_lib.ATTENTION_PROBS, 'explicit_softmax', explicit_softmax)
  fused_config = small_config()
  explicit_config = small_config(attention_probs='explicit_softmax')
  params = init_params(fused_config)
  rng = np.random.default_rng(12)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  inputs[0, 5:], targets[0, 4:] = 0, 0
  fused = np.asarray(make_forward(fused_config)(params, inputs, targets))
  explicit = np.asarray(make_forward(explicit_config)(params, inputs, targets))
  # 2 encoder self-attentions + 2 x (self + cross) in the decoder.
  assert len(calls) == 6
  assert max_abs(fused[1], explicit[1]) < 1e-5
  assert max_abs(fused[0, :4], explicit[0, :4]) < 1e-5


# --------------------------------------------------------------------------------------------
# 11. Configuration errors.


def test_config_errors():
  with pytest.raises(ValueError, match='divisible'):
    TransformerConfig(vocab_size=VOCAB, d_model=30, num_heads=4)
  with pytest.raises(ValueError, match="norm must be 'layer' or 'scale', got 'rms'"):
    small_config(norm='rms')
  config = small_config(max_len=8)
  params = init_params(small_config())  # max_len does not change the parameters.
  model = Transformer(config)
  # Shape-only evaluation: the errors are raised while tracing.
  def apply(*args, method='__call__'):
    return jax.eval_shape(lambda: model.apply({'params': params}, *args, method=method))

  short, long = np.full((1, 8), 5, np.int32), np.full((1, 9), 5, np.int32)
  assert apply(short, short).shape == (1, 8, VOCAB)  # Exactly max_len is fine.
  with pytest.raises(ValueError, match=r'Source length 9 exceeds .*max_len=8'):
    apply(long, short)
  with pytest.raises(ValueError, match=r'Target length 9 exceeds .*max_len=8'):
    apply(short, long)
  encoded = apply(short, method='encode')
  with pytest.raises(ValueError, match=r'Decoding length 9 exceeds .*max_len=8'):
    apply(encoded, short, 1, 9, method='init_decode_cache')


@pytest.mark.parametrize('cpu_tuned', [True, False])
def test_output_layer_over_the_first_ids_gives_those_ids_logits(cpu_tuned):
  """output_vocab_size=N: the same parameters (shared embeddings), the logits of ids 0..N-1
  of the whole vocabulary's output layer, in teacher forcing and in cached decoding; beam
  search then writes only those ids."""
  outputs = 24
  whole = small_config(cpu_tuned=cpu_tuned, dropout_rate=0.0)
  part = small_config(cpu_tuned=cpu_tuned, dropout_rate=0.0, output_vocab_size=outputs)
  params = init_params(whole)
  assert jax.tree_util.tree_map(np.shape, init_params(part)) == jax.tree_util.tree_map(
      np.shape, params)
  rng = np.random.default_rng(12)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT, vocab=outputs)
  full = np.asarray(make_forward(whole)(params, inputs, targets))
  logits = np.asarray(make_forward(part)(params, inputs, targets))
  assert logits.shape == TGT + (outputs,)
  assert max_abs(logits, full[..., :outputs]) < 1e-5
  assert max_abs(full[..., outputs:], 0.0) > 0.1  # The ids left out had logits of their own.
  decoder = CachedDecoder(part, params, inputs, beam_size=1, max_length=TGT[1])
  decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))
  for t in range(TGT[1]):
    step_logits = decoder.step(decoder_inputs[:, t:t + 1], t)
    assert max_abs(step_logits[:, 0], full[:, t, :outputs]) < 1e-4, f'step {t}'
  # Without the left-out ids' logits, the most likely next ids of this random model would
  # often be among them: the search writes none.
  sequences, _ = transformer_beam_search(Transformer(part), params, inputs, beam_size=3,
                                         max_extra_length=6)
  assert np.asarray(sequences).max() < outputs
  assert np.argmax(full, axis=-1).max() >= outputs
  separate = small_config(share_embeddings=False, output_vocab_size=outputs)
  assert init_params(separate)['output_projection']['kernel'].shape == (32, outputs)
  for size, message in ((VOCAB + 1, r'output_vocab_size must be in \[0, vocab_size=53\]'),
                        (-1, 'output_vocab_size must be in'), (1, 'leaves out EOS')):
    with pytest.raises(ValueError, match=message):
      small_config(output_vocab_size=size)


# --------------------------------------------------------------------------------------------
# 11. Dropout's counter-based keep mask.


def test_scale_norm_gives_every_position_the_learned_length():
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((3, 5, 16)) * rng.uniform(0.1, 10, (3, 5, 1)), jnp.float32)
  layer = ScaleNorm()
  params = layer.init(jax.random.key(0), x)['params']
  assert params['scale'].shape == () and float(params['scale']) == pytest.approx(4.0)  # sqrt(16).
  for g in (4.0, 2.5):
    y = np.asarray(layer.apply({'params': {'scale': jnp.float32(g)}}, x))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), g, rtol=1e-5)
    np.testing.assert_allclose(y / g, np.asarray(x) / np.linalg.norm(x, axis=-1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
  # In a pre-LN model every norm is one scalar, so LayerNorm's 2 * d_model become 1.
  config = small_config(pre_norm=True, norm='scale')
  norms = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(init_params(config))[0]
           if any(getattr(k, 'key', '') == 'norm' for k in path)]
  assert len(norms) == 2 * 2 + 3 * 2 + 2 and all(n.shape == () for n in norms)


def test_fix_norm_uses_only_the_direction_of_each_embedding_row():
  # FixNorm: lengthening or shortening any row of the shared embedding changes nothing, in the
  # embedded sources and targets and in the output layer alike; without it, everything.
  rng = np.random.default_rng(12)
  inputs, targets = random_tokens(rng, SRC), random_tokens(rng, TGT)
  lengths = rng.uniform(0.2, 5.0, (VOCAB, 1)).astype(np.float32)
  for fix_norm in (True, False):
    config = small_config(pre_norm=True, norm='scale', fix_norm=fix_norm)
    params, forward = init_params(config), make_forward(config)
    rescaled = {**params, 'embed': {'embedding': params['embed']['embedding'] * lengths}}
    change = max_abs(np.asarray(forward(rescaled, inputs, targets)),
                     np.asarray(forward(params, inputs, targets)))
    assert change < 1e-4 if fix_norm else change > 0.1, (fix_norm, change)
  # Embedded tokens have the paper's length sqrt(d_model) before the positions are added.
  config = small_config(fix_norm=True, positional='learned')
  params = {**init_params(config), 'position_embed': {'embedding': jnp.zeros((32, 32))}}
  embedded = Transformer(config).apply({'params': params}, inputs, np.zeros_like(inputs), True,
                                       False, method=Transformer._embed)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(embedded), axis=-1), 32 ** 0.5, rtol=1e-5)
  with pytest.raises(ValueError, match='share_embeddings'):
    small_config(fix_norm=True, share_embeddings=False)


def test_dropout_keep_mask_is_bernoulli_and_independent():
  keep_prob, shape = 0.9, (64, 128, 128)  # 1M entries.
  mask = np.asarray(jax.jit(cpu_dropout.dropout_keep_mask, static_argnums=(1, 2))(
      jax.random.key(0), shape, keep_prob))
  n = mask.size
  sigma = math.sqrt(keep_prob * (1 - keep_prob) / n)
  assert abs(mask.mean() - keep_prob) < 5 * sigma
  # No structure along any axis or between neighbours: per-slice rates and lagged agreement.
  for axis in range(3):
    rates = mask.mean(axis=tuple(a for a in range(3) if a != axis))
    slice_sigma = math.sqrt(keep_prob * (1 - keep_prob) / (n // shape[axis]))
    assert np.abs(rates - keep_prob).max() < 6 * slice_sigma
  flat = mask.reshape(-1).astype(np.float64)
  for lag in (1, 2, 16, 128, 128 * 128):
    correlation = np.corrcoef(flat[:-lag], flat[lag:])[0, 1]
    assert abs(correlation) < 5 / math.sqrt(n), (lag, correlation)
  # Another key gives an independent mask; the same key the same mask.
  other = np.asarray(cpu_dropout.dropout_keep_mask(jax.random.key(1), shape, keep_prob))
  both = (mask & other).mean()
  assert abs(both - keep_prob**2) < 5 * math.sqrt(keep_prob**2 * (1 - keep_prob**2) / n)
  again = np.asarray(cpu_dropout.dropout_keep_mask(jax.random.key(0), shape, keep_prob))
  assert np.array_equal(mask, again)


def test_dropout_module_scales_kept_entries_and_is_off_in_eval():
  x = jax.random.normal(jax.random.key(3), (8, 16, 32))
  layer = cpu_dropout.HashDropout(rate=0.25)
  out = np.asarray(layer.apply({}, x, deterministic=False, rngs={'dropout': jax.random.key(4)}))
  kept = out != 0
  np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
  assert 0.65 < kept.mean() < 0.85
  assert np.array_equal(np.asarray(layer.apply({}, x, deterministic=True)), np.asarray(x))
  # Its gradient is the same mask and scale.
  grad = np.asarray(jax.grad(lambda v: layer.apply(
      {}, v, deterministic=False, rngs={'dropout': jax.random.key(4)}).sum())(x))
  np.testing.assert_allclose(grad, np.where(kept, 1 / 0.75, 0.0), rtol=1e-6)


@pytest.mark.parametrize('dtype, atol', [(jnp.float32, 2e-5), (jnp.bfloat16, 5e-2)])
def test_layer_norm_matches_flax_in_values_and_gradients(dtype, atol):
  # The CPU LayerNorm has a hand-written derivative: it must be nn.LayerNorm's, exactly
  # in float32 (up to rounding), on random inputs whose rows have non-zero means.
  keys = jax.random.split(jax.random.key(7), 5)
  x = (jax.random.normal(keys[0], (3, 5, 48)) * 2 + jax.random.normal(keys[1], (3, 5, 1)))
  params = {'scale': 1 + 0.3 * jax.random.normal(keys[2], (48,)),
            'bias': 0.3 * jax.random.normal(keys[3], (48,))}
  cotangent = jax.random.normal(keys[4], x.shape)
  ours = cpu_layer_norm.LayerNorm(epsilon=1e-6, dtype=dtype)
  flax_norm = nn.LayerNorm(epsilon=1e-6, dtype=dtype)
  assert jax.tree_util.tree_structure(ours.init(keys[0], x)) == jax.tree_util.tree_structure(
      flax_norm.init(keys[0], x))

  def value_and_grads(module):
    def f(params, x):
      return module.apply({'params': params}, x.astype(dtype))
    y, vjp = jax.vjp(f, params, x)
    return y, vjp(cotangent.astype(y.dtype))

  (y, (dparams, dx)), (y_ref, (dparams_ref, dx_ref)) = (value_and_grads(ours),
                                                        value_and_grads(flax_norm))
  assert y.dtype == y_ref.dtype == dtype
  f32 = lambda a: np.asarray(a, np.float32)
  np.testing.assert_allclose(f32(y), f32(y_ref), atol=atol)
  np.testing.assert_allclose(f32(dx), f32(dx_ref), atol=atol, rtol=atol)
  for name in ('scale', 'bias'):
    np.testing.assert_allclose(f32(dparams[name]), f32(dparams_ref[name]), atol=atol * 10,
                               rtol=atol)
