"""Reference formulas: each attention score, probability map, linear attention, the RNN's
attention, label smoothing, the learning-rate schedule and the length penalty against a plain
float64 numpy implementation of the published formula, on random inputs and parameters.

The other tests check self-consistency (causality, padding, packing, cached against full
decoding); a formula changed alike on every path passes them. Here each test rebuilds the
numbers from the paper's equation with the module's own parameters, pulled from its parameter
tree. `tests/mutations.py` breaks the product one line at a time to show that these catch it.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from model import (
  EOS_ID,
  RNN,
  UNK_ID,
  MultiHeadAttention,
  RNNConfig,
  Transformer,
  TransformerConfig,
  beam_search,
  decode_cache,
  length_penalty,
  linear_attention,
  masks,
)
from nmt import optimization

# float32 computations against float64 references, on values of order 1.
RTOL, ATOL = 1e-4, 1e-5
D_MODEL, HEADS = 8, 2
HEAD_DIM = D_MODEL // HEADS
BATCH, Q_LEN, K_LEN = 2, 5, 6


def tiny_config(**overrides) -> TransformerConfig:
  settings = dict(vocab_size=13, d_model=D_MODEL, num_heads=HEADS, d_ff=16, num_encoder_layers=1,
                  num_decoder_layers=1, dropout_rate=0.0, max_len=16)
  return TransformerConfig(**{**settings, **overrides})


def randomized(tree, rng: np.random.Generator, scale: float = 0.5):
  """`tree` with every leaf replaced by normal noise (no zero biases, no identity kernels)."""
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.normal(size=p.shape) * scale, p.dtype), tree)


def as_numpy(tree):
  return jax.tree_util.tree_map(lambda p: np.asarray(p, np.float64), tree)


# --------------------------------------------------------------------------------------------
# Probability maps written from their papers, on one row of allowed scores (float64).


def softmax_row(z: np.ndarray) -> np.ndarray:
  e = np.exp(z - z.max())
  return e / e.sum()


def sparsemax_row(z: np.ndarray) -> np.ndarray:
  """Martins & Astudillo (2016), Proposition 1: with z sorted decreasingly as z_(1) >= ...,
  k(z) = max{k : 1 + k z_(k) > sum_{j<=k} z_(j)}, tau = (sum_{j<=k(z)} z_(j) - 1) / k(z),
  sparsemax(z)_i = max(z_i - tau, 0)."""
  ordered = np.sort(z)[::-1]
  k = np.arange(1, len(z) + 1)
  support = k[1 + k * ordered > np.cumsum(ordered)].max()
  tau = (ordered[:support].sum() - 1) / support
  return np.maximum(z - tau, 0)


def entmax15_row(z: np.ndarray) -> np.ndarray:
  """Peters, Niculae & Martins (2019), "Sparse Sequence-to-Sequence Models": alpha-entmax(z)_i =
  [(alpha - 1) z_i - tau]_+^(1 / (alpha - 1)), for alpha = 1.5 max(z_i / 2 - tau, 0)^2, with
  tau the root of sum_i p_i = 1, found here by bisection (not the product's sort)."""
  mass = lambda tau: np.sum(np.maximum(z / 2 - tau, 0) ** 2)
  low, high = z.max() / 2 - 1, z.max() / 2  # mass(low) >= 1 > mass(high) = 0.
  for _ in range(200):
    middle = (low + high) / 2
    low, high = (middle, high) if mass(middle) >= 1 else (low, middle)
  return np.maximum(z / 2 - (low + high) / 2, 0) ** 2


PROBABILITY_MAPS = {'softmax': softmax_row, 'sparsemax': sparsemax_row,
                    'entmax15': entmax15_row}


def masked_rows(logits: np.ndarray, mask: np.ndarray, row_map) -> np.ndarray:
  """row_map over the allowed keys of every row of logits [..., k]; 0 at masked keys."""
  out = np.zeros_like(logits)
  mask = np.broadcast_to(mask, logits.shape)
  for index in np.ndindex(logits.shape[:-1]):
    allowed = mask[index]
    out[index][allowed] = row_map(logits[index][allowed])
  return out


# --------------------------------------------------------------------------------------------
# Multi-head attention (Vaswani et al. 2017, Section 3.2) with each score and probability map.


def reference_attention(params, x, context, mask, score, probs):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K,
  V W_i^V) (Vaswani et al. 2017, Section 3.2.2), with the query and value projections' biases,
  and Attention = probs(score(q, k)) V. Returns the output [batch, q, d_model] and the
  weights [batch, heads, q, k]."""
  p = as_numpy(params)
  x, context = np.asarray(x, np.float64), np.asarray(context, np.float64)
  q = np.einsum('bqm,mhd->bqhd', x, p['query']['kernel']) + p['query']['bias']
  k = np.einsum('bkm,mhd->bkhd', context, p['key']['kernel'])
  v = np.einsum('bkm,mhd->bkhd', context, p['value']['kernel']) + p['value']['bias']
  d_k = q.shape[-1]
  if score == 'scaled_dot':  # Eq. 1: QK^T / sqrt(d_k).
    logits = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(d_k)
  elif score == 'dot':  # The same without the scale (Luong et al. 2015, Eq. 8, "dot").
    logits = np.einsum('bqhd,bkhd->bhqk', q, k)
  elif score == 'bilinear':  # q^T W k per head (Luong et al. 2015, Eq. 8, "general").
    logits = np.einsum('bqhd,hde,bkhe->bhqk', q, p['score_kernel'], k)
  else:  # v^T tanh(q + k) per head (Bahdanau et al. 2015, Appendix A.1.2).
    hidden = np.tanh(q.transpose(0, 2, 1, 3)[:, :, :, None] + k.transpose(0, 2, 1, 3)[:, :, None])
    logits = np.einsum('bhqkd,hd->bhqk', hidden, p['score_vector'])
  weights = masked_rows(logits, mask, PROBABILITY_MAPS[probs])
  heads = np.einsum('bhqk,bkhd->bqhd', weights, v)
  return np.einsum('bqhd,hdm->bqm', heads, p['out']['kernel']) + p['out']['bias'], weights


def attention_inputs(rng):
  """Queries x [batch, q, d_model], a source [batch, k, d_model], a causal self-attention mask
  and a cross-attention mask, both with padding keys; every query has an allowed key."""
  x = rng.normal(size=(BATCH, Q_LEN, D_MODEL)).astype(np.float32)
  context = rng.normal(size=(BATCH, K_LEN, D_MODEL)).astype(np.float32)
  target_real = np.array([[True] * Q_LEN, [True] * (Q_LEN - 1) + [False]])
  source_real = np.array([[True] * K_LEN, [True] * (K_LEN - 2) + [False] * 2])
  causal = np.tril(np.ones((Q_LEN, Q_LEN), bool))
  self_mask = (target_real[:, None, None, :] & causal)  # [batch, 1, q, q]
  cross_mask = np.broadcast_to(source_real[:, None, None, :], (BATCH, 1, Q_LEN, K_LEN))
  return x, context, self_mask, np.ascontiguousarray(cross_mask)


def run_attention(config, params, x, context, self_mask, cross_mask):
  """Self- and cross-attention, each by `apply` (the fused path for the paper's attention)
  and with its weights recorded (the explicit path): ({name: output}, {name: weights})."""
  module = MultiHeadAttention(config)

  @jax.jit
  def run(params, x, context, self_mask, cross_mask):
    outputs, weights = {}, {}
    for name, source, mask in (('self', x, self_mask), ('cross', context, cross_mask)):
      outputs[name] = module.apply({'params': params}, x, source, mask, False)
      outputs[name + '_recorded'], recorded = module.apply(
          {'params': params}, x, source, mask, False, mutable=['intermediates'])
      weights[name] = recorded['intermediates']['attention_weights'][0]
    return outputs, weights

  return run(params, x, context, self_mask, cross_mask)


def init_attention(config, rng):
  x, context, self_mask, cross_mask = attention_inputs(rng)
  params = jax.jit(MultiHeadAttention(config).init, static_argnums=4)(
      jax.random.key(0), x, context, cross_mask, False)['params']
  return params, (x, context, self_mask, cross_mask)


@pytest.mark.parametrize('score', ['scaled_dot', 'dot', 'bilinear', 'additive'])
def test_attention_scores_with_softmax_equal_their_formulas(score):
  """softmax(score(q, k)) V through the heads (Vaswani et al. 2017, Eq. 1 and Section 3.2.2):
  'scaled_dot' q.k / sqrt(d_k) (Eq. 1), 'dot' q.k (Luong et al. 2015, Eq. 8), 'bilinear'
  q^T W k per head (Luong's "general"), 'additive' v^T tanh(q + k) per head on the projected q
  and k (Bahdanau et al. 2015, Appendix A.1.2); causal self-attention and cross-attention,
  with padding keys, by the fused and the explicit path; random parameters."""
  config = tiny_config(attention_score=score)
  rng = np.random.default_rng(0)
  params, inputs = init_attention(config, rng)
  params = randomized(params, rng)
  outputs, weights = run_attention(config, params, *inputs)
  x, context, self_mask, cross_mask = inputs
  for name, source, mask in (('self', x, self_mask), ('cross', context, cross_mask)):
    want, want_weights = reference_attention(params, x, source, mask, score, 'softmax')
    np.testing.assert_allclose(outputs[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(outputs[name + '_recorded'], want, rtol=RTOL, atol=ATOL,
                               err_msg=name)
    np.testing.assert_allclose(weights[name], want_weights, rtol=RTOL, atol=ATOL, err_msg=name)
  # The comparison can fail: the other dot-product score differs by a factor sqrt(d_k).
  if score in ('scaled_dot', 'dot'):
    other = reference_attention(params, x, x, self_mask,
                                {'dot': 'scaled_dot', 'scaled_dot': 'dot'}[score], 'softmax')[0]
    assert np.max(np.abs(other - outputs['self'])) > 1e-2


@pytest.mark.parametrize('probs', ['sparsemax', 'entmax15'])
def test_sparse_probability_maps_in_attention_equal_their_formulas(probs):
  """sparsemax (Martins & Astudillo 2016, Proposition 1: max(z - tau, 0) with tau from the
  sorted scores) and 1.5-entmax (Peters et al. 2019: max(z / 2 - tau, 0)^2, tau by bisection)
  in place of softmax over the scaled dot-product scores q.k / sqrt(d_k) (Vaswani et al. 2017,
  Eq. 1); masked keys get exactly 0."""
  config = tiny_config(attention_probs=probs)
  rng = np.random.default_rng(1)
  params, inputs = init_attention(config, rng)
  params = randomized(params, rng, scale=1.0)  # Larger scores: supports smaller than the row.
  outputs, weights = run_attention(config, params, *inputs)
  x, context, self_mask, cross_mask = inputs
  for name, source, mask in (('self', x, self_mask), ('cross', context, cross_mask)):
    want, want_weights = reference_attention(params, x, source, mask, 'scaled_dot', probs)
    np.testing.assert_allclose(outputs[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(weights[name], want_weights, rtol=RTOL, atol=ATOL, err_msg=name)
    got = np.asarray(weights[name])
    assert np.all(got[~np.broadcast_to(mask, got.shape)] == 0), name
    # Meaningful only if some allowed keys get exactly 0 and some rows spread over several.
    allowed_zeros = (want_weights == 0) & np.broadcast_to(mask, want_weights.shape)
    assert allowed_zeros.any() and ((want_weights > 0).sum(-1) > 1).any(), name


def test_bilinear_score_starts_as_the_scaled_dot_product():
  """The bilinear kernel W starts as I / sqrt(d_k) in every head, so q^T W k starts as the
  paper's q.k / sqrt(d_k) (Vaswani et al. 2017, Eq. 1)."""
  config = tiny_config(attention_score='bilinear')
  rng = np.random.default_rng(2)
  params, inputs = init_attention(config, rng)
  np.testing.assert_allclose(params['score_kernel'], np.broadcast_to(
      np.eye(HEAD_DIM) / np.sqrt(HEAD_DIM), (HEADS, HEAD_DIM, HEAD_DIM)), rtol=1e-7)
  # Random projections, the kernel as initialised.
  params = {**randomized(params, rng), 'score_kernel': params['score_kernel']}
  outputs, _ = run_attention(config, params, *inputs)
  x, context, self_mask, cross_mask = inputs
  for name, source, mask in (('self', x, self_mask), ('cross', context, cross_mask)):
    want, _ = reference_attention(params, x, source, mask, 'scaled_dot', 'softmax')
    np.testing.assert_allclose(outputs[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


# --------------------------------------------------------------------------------------------
# Masks.


def test_attention_mask_is_padding_segments_and_the_causal_triangle():
  """A query attends to a key iff both are real tokens, of the same packed segment, and, with
  `causal`, the key is not after the query (Vaswani et al. 2017, Section 3.2.3: "preventing
  leftward information flow")."""
  tokens = np.array([[5, 6, 7, 8, 9, 4, 0], [3, 4, 5, 6, 0, 0, 0]], np.int32)
  segmentation = np.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0]], np.int32)
  real = tokens > 0
  for causal, segmented in itertools.product((False, True), repeat=2):
    seg = segmentation if segmented else None
    got = np.asarray(masks.attention_mask(tokens, tokens, seg, seg, causal=causal))
    want = np.zeros((2, 1, 7, 7), bool)
    for b, i, j in itertools.product(range(2), range(7), range(7)):
      want[b, 0, i, j] = (real[b, i] and real[b, j]
                          and (not segmented or segmentation[b, i] == segmentation[b, j])
                          and (not causal or j <= i))
    np.testing.assert_array_equal(got, want, err_msg=f'causal={causal} segmented={segmented}')
    segments = masks.segment_ids(tokens, seg)
    dense = masks.LinearMask(segments, segments, causal, segmented).dense()
    np.testing.assert_array_equal(np.asarray(dense), want)


# --------------------------------------------------------------------------------------------
# Linear attention (Katharopoulos et al. 2020).


def elu_plus_one(x):
  """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, Eq. 7)."""
  return np.where(x > 0, x + 1, np.exp(x))


def reference_linear_attention(params, x, context, allowed):
  """V'_i = sum_j phi(Q_i)^T phi(K_j) V_j / sum_j phi(Q_i)^T phi(K_j) over the allowed keys
  j (Katharopoulos et al. 2020, Eq. 4-6; Eq. 8 with the causal limit j <= i), per head, then
  W^O; a query with no allowed key reads 0. allowed: [batch, q, k] bool."""
  p = as_numpy(params)
  x, context = np.asarray(x, np.float64), np.asarray(context, np.float64)
  q = elu_plus_one(np.einsum('bqm,mhd->bqhd', x, p['query']['kernel']) + p['query']['bias'])
  k = elu_plus_one(np.einsum('bkm,mhd->bkhd', context, p['key']['kernel']))
  v = np.einsum('bkm,mhd->bkhd', context, p['value']['kernel']) + p['value']['bias']
  similarity = np.einsum('bqhd,bkhd->bhqk', q, k) * allowed[:, None]
  total = similarity.sum(-1, keepdims=True)
  heads = np.einsum('bhqk,bkhd->bqhd', similarity / np.where(total > 0, total, 1), v)
  return np.einsum('bqhd,hdm->bqm', heads, p['out']['kernel']) + p['out']['bias']


def test_linear_attention_equals_the_kernel_formula():
  """Linear attention, non-causal (Katharopoulos et al. 2020, Eq. 5-6), causal (Eq. 8-10) and
  causal over packed segments, against the sums over keys written out (Eq. 4)."""
  config = tiny_config(linear_attention=True)
  rng = np.random.default_rng(3)
  x = rng.normal(size=(BATCH, Q_LEN, D_MODEL)).astype(np.float32)
  context = rng.normal(size=(BATCH, K_LEN, D_MODEL)).astype(np.float32)
  module = MultiHeadAttention(config)
  ones = lambda length: np.ones((BATCH, length), np.int32)
  params = randomized(jax.eval_shape(lambda: module.init(
      jax.random.key(0), x, x, masks.LinearMask(ones(Q_LEN), ones(Q_LEN), False, False),
      False))['params'], rng)
  query_segments = np.array([[1] * Q_LEN, [1] * (Q_LEN - 1) + [0]], np.int32)
  key_segments = np.array([[1] * K_LEN, [1] * (K_LEN - 2) + [0] * 2], np.int32)
  packed_segments = np.array([[1, 1, 2, 2, 2], [1, 2, 2, 2, 0]], np.int32)
  cases = {  # name: (keys from, query segments, key segments, causal, packed)
      'cross': ('context', query_segments, key_segments, False, False),
      'causal': ('x', query_segments, query_segments, True, False),
      'packed_causal': ('x', packed_segments, packed_segments, True, True),
  }

  @jax.jit
  def run(params, x, context):
    sources = {'x': x, 'context': context}
    return {name: module.apply({'params': params}, x, sources[source],
                               masks.LinearMask(q_seg, k_seg, causal, packed), False)
            for name, (source, q_seg, k_seg, causal, packed) in cases.items()}

  got = run(params, x, context)
  for name, (source, q_seg, k_seg, causal, _) in cases.items():
    allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg > 0)[:, :, None]
    if causal:
      allowed &= np.tril(np.ones((Q_LEN, Q_LEN), bool))
    want = reference_linear_attention(params, x, {'x': x, 'context': context}[source], allowed)
    np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


def test_linear_attention_decoding_state_steps_through_the_causal_values():
  """Decoding: S_i = S_{i-1} + phi(K_i) V_i^T, Z_i = Z_{i-1} + phi(K_i), V'_i = phi(Q_i)^T S_i /
  phi(Q_i)^T Z_i (Katharopoulos et al. 2020, Eq. 9-10 and Section 3.4) through the decoder's
  self-attention step gives the causal sums of Eq. 8 at every step, and a state of the
  whole source read by the cross-attention step gives Eq. 5's non-causal values."""
  config = tiny_config(linear_attention=True)
  rng = np.random.default_rng(4)
  x = rng.normal(size=(BATCH, Q_LEN, D_MODEL)).astype(np.float32)
  context = rng.normal(size=(BATCH, K_LEN, D_MODEL)).astype(np.float32)
  source_real = np.array([[True] * K_LEN, [True] * (K_LEN - 2) + [False] * 2])
  module = MultiHeadAttention(config)
  ones = np.ones((BATCH, Q_LEN), np.int32)
  params = randomized(jax.eval_shape(lambda: module.init(
      jax.random.key(0), x, x, masks.LinearMask(ones, ones, False, False), False))['params'], rng)

  def decode(attention, x, context, source_real):
    state = linear_attention.initial_state((BATCH, 1), HEADS, HEAD_DIM)
    steps = []
    for t in range(Q_LEN):  # One hypothesis per sentence: beam axis 1.
      out, written = decode_cache.self_attention_step(attention, x[:, t:t + 1], jnp.asarray(t),
                                                      {'self_state': state}, None)
      state = written['self_state']
      steps.append(out)
    keys, values = attention.project_keys_values(context)
    cross_state = linear_attention.summed_state(keys, values, source_real)
    cross = decode_cache.cross_attention_step(attention, x, {'cross_state': cross_state}, None)
    return jnp.concatenate(steps, axis=1), state, cross

  steps, state, cross = jax.jit(lambda params, *args: module.apply(
      {'params': params}, *args, method=decode))(params, x, context, source_real)
  causal = np.broadcast_to(np.tril(np.ones((Q_LEN, Q_LEN), bool)), (BATCH, Q_LEN, Q_LEN))
  np.testing.assert_allclose(steps, reference_linear_attention(params, x, x, causal),
                             rtol=RTOL, atol=ATOL)
  # The state after the last step: S = sum_j phi(K_j) V_j^T and Z = sum_j phi(K_j).
  p = as_numpy(params)
  k = elu_plus_one(np.einsum('bkm,mhd->bkhd', x, p['key']['kernel']))
  v = np.einsum('bkm,mhd->bkhd', x, p['value']['kernel']) + p['value']['bias']
  np.testing.assert_allclose(state[:, 0, :, :, :-1], np.einsum('bkhd,bkhe->bhde', k, v),
                             rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(state[:, 0, :, :, -1], k.sum(1), rtol=RTOL, atol=ATOL)
  allowed = np.broadcast_to(source_real[:, None, :], (BATCH, Q_LEN, K_LEN))
  np.testing.assert_allclose(cross, reference_linear_attention(params, x, context, allowed),
                             rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# Embeddings and positions.


def test_layer_inputs_are_scaled_embeddings_plus_sinusoids_from_position_0():
  """The first encoder and decoder layers read E[token] * sqrt(d_model) (Vaswani et al. 2017,
  Section 3.4) + PE[pos] with PE[pos, 2i] = sin(pos / 10000^(2i / d_model)), PE[pos, 2i + 1] =
  cos(pos / 10000^(2i / d_model)) (Section 3.5), pos = 0, 1, ... along each row; the decoder
  reads the targets shifted right behind the start symbol 0."""
  config = tiny_config()
  model = Transformer(config)
  rng = np.random.default_rng(5)
  inputs = rng.integers(3, 13, size=(BATCH, K_LEN)).astype(np.int32)
  targets = rng.integers(3, 13, size=(BATCH, Q_LEN)).astype(np.int32)
  params = randomized(jax.eval_shape(model.init, jax.random.key(0), inputs, targets)['params'],
                      rng)

  @jax.jit
  def layer_inputs(params, inputs, targets):
    captured = {}

    def record(next_fun, args, kwargs, context):
      module = context.module
      if context.method_name == '__call__' and module.name == 'layers_0':
        captured[module.parent.name] = args[0]
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      model.apply({'params': params}, inputs, targets)
    return captured

  got = layer_inputs(params, inputs, targets)
  embedding = np.asarray(params['embed']['embedding'], np.float64)
  position = np.arange(config.max_len)[:, None]
  angle = position / 10000 ** (2 * np.arange(D_MODEL // 2)[None, :] / D_MODEL)
  table = np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(config.max_len, D_MODEL)
  decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  for name, tokens in (('encoder', inputs), ('decoder', decoder_inputs)):
    want = embedding[tokens] * np.sqrt(D_MODEL) + table[:tokens.shape[1]]
    np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


# --------------------------------------------------------------------------------------------
# The attentional RNN (Bahdanau et al. 2015; Luong et al. 2015).


def sigmoid(x):
  return 1 / (1 + np.exp(-x))


def lstm_step(p, x, cell, hidden):
  """The LSTM without peepholes (Hochreiter & Schmidhuber 1997, with the forget gate of Gers et
  al. 2000), flax's parameter names: i, f, o = sigmoid(W_i* x + W_h* h + b_h*), g = tanh(W_ig x
  + W_hg h + b_hg), c' = f c + i g, h' = o tanh(c')."""
  gate = lambda name: x @ p['i' + name]['kernel'] + hidden @ p['h' + name]['kernel'] + (
      p['h' + name]['bias'])
  i, f, g, o = sigmoid(gate('i')), sigmoid(gate('f')), np.tanh(gate('g')), sigmoid(gate('o'))
  cell = f * cell + i * g
  return cell, o * np.tanh(cell)


def reference_rnn_decoder(params, config, encoded, inputs, targets):
  """Teacher-forced logits of the attentional decoder, step by step (float64):
    x_t = [E y_{t-1}; a_{t-1}] with input feeding (Luong et al. 2015, Section 3.3), else E y_{t-1}
    h_t = LSTM stack(x_t), from zero states
    score(h_t, e_s) = v^T tanh(W_q h_t + W_k e_s) (Bahdanau et al. 2015, Appendix A.1.2),
      h_t^T e_s ('dot') or h_t^T W e_s ('general') (Luong et al. 2015, Eq. 8)
    alpha_t = softmax over the real source positions, c_t = sum_s alpha_ts e_s
    a_t = tanh(W_c [c_t; h_t]) (Luong et al. 2015, Eq. 5), logits W_o a_t + b_o (Eq. 6)."""
  p = as_numpy(params)
  d = p['decoder']
  hidden_dim = config.hidden_dim
  logits = np.zeros(targets.shape + (config.vocab_size,))
  for b in range(targets.shape[0]):
    memory = np.asarray(encoded[b], np.float64)[inputs[b] > 0]  # Real source positions.
    keys = memory if config.attention_score == 'dot' else memory @ p['memory_projection'][
        'kernel']
    cells = [np.zeros(hidden_dim) for _ in range(config.num_decoder_layers)]
    hiddens = [np.zeros(hidden_dim) for _ in range(config.num_decoder_layers)]
    attentional = np.zeros(hidden_dim)
    previous = 0  # The start symbol.
    for t in range(targets.shape[1]):
      x = p['embed']['embedding'][previous]
      if config.input_feeding:
        x = np.concatenate([x, attentional])
      for layer in range(config.num_decoder_layers):
        cells[layer], hiddens[layer] = lstm_step(d[f'lstm_{layer}'], x, cells[layer],
                                                 hiddens[layer])
        x = hiddens[layer]
      if config.attention_score == 'additive':
        scores = np.tanh(x @ d['query']['kernel'] + keys) @ d['score']['kernel'][:, 0]
      else:
        scores = keys @ x
      context = softmax_row(scores) @ memory
      attentional = np.tanh(np.concatenate([context, x]) @ d['combine']['kernel'])
      logits[b, t] = (attentional @ p['output_projection']['kernel']
                      + p['output_projection']['bias'])
      previous = targets[b, t]
  return logits


@pytest.mark.parametrize('score, input_feeding', [
    ('additive', True), ('dot', False), ('general', True)])
def test_rnn_decoder_follows_its_documented_recurrence(score, input_feeding):
  """The RNN's teacher-forced logits equal the recurrence of model/rnn.py's docstring written
  out in numpy (see `reference_rnn_decoder`): Bahdanau's additive score, Luong's dot and
  general scores, the attentional vector tanh(W_c [c_t; h_t]) and input feeding; two decoder
  layers, a padded source, random parameters, the encoder states taken from the model."""
  config = RNNConfig(vocab_size=7, embed_dim=3, hidden_dim=4, num_encoder_layers=1,
                     num_decoder_layers=2, dropout_rate=0.0, attention_score=score,
                     input_feeding=input_feeding)
  model = RNN(config)
  rng = np.random.default_rng(6)
  inputs = rng.integers(3, 7, size=(BATCH, K_LEN)).astype(np.int32)
  inputs[1, -2:] = 0
  targets = rng.integers(3, 7, size=(BATCH, Q_LEN)).astype(np.int32)
  params = randomized(jax.eval_shape(model.init, jax.random.key(0), inputs, targets)['params'],
                      rng)
  lstm_inputs = params['decoder']['lstm_0']['ii']['kernel'].shape[0]
  assert lstm_inputs == config.embed_dim + (config.hidden_dim if input_feeding else 0)
  # 'general' and 'additive' project the encoder states (W e, W_k e); 'dot' has no W.
  projects_memory = 'memory_projection' in params
  assert projects_memory == (score != 'dot'), f'{score}: W e in the params: {projects_memory}'

  @jax.jit
  def run(params, inputs, targets):
    variables = {'params': params}
    return model.apply(variables, inputs, method='encode'), model.apply(variables, inputs,
                                                                        targets)

  encoded, logits = run(params, inputs, targets)
  want = reference_rnn_decoder(params, config, np.asarray(encoded), inputs, targets)
  np.testing.assert_allclose(logits, want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# Training: label smoothing and the learning-rate schedule.


def label_smoothed_loss(logits, targets, weights, smoothing) -> float:
  """sum over tokens of weight * KL(q || softmax(logits)), q the smoothed targets (float64)."""
  logits = np.asarray(logits, np.float64)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  q = np.full(logits.shape, smoothing / (logits.shape[-1] - 1))
  np.put_along_axis(q, targets[..., None], 1 - smoothing, axis=-1)
  terms = np.where(q > 0, q * (np.log(np.where(q > 0, q, 1)) - log_p), 0.0)
  return float((terms.sum(-1) * weights).sum())


@pytest.mark.parametrize('smoothing', [0.0, 0.1, 0.3])
def test_label_smoothed_loss_is_the_kl_divergence_to_the_smoothed_targets(smoothing):
  """nmt/optimization.py's documented loss: the cross-entropy against q = 1 - eps on the target
  and eps / (V - 1) on every other token (label smoothing, Szegedy et al. 2016, Section 7; eps
  0.1 in Vaswani et al. 2017, Section 5.4) minus q's entropy, i.e. KL(q || p) =
  sum_k q_k log(q_k / p_k), summed over the weighted tokens; 'nll' is -log p(target)."""
  rng = np.random.default_rng(7)
  vocab = 9
  logits = rng.normal(size=(2, 4, vocab)) * 2
  targets = rng.integers(0, vocab, size=(2, 4))
  weights = rng.uniform(0.5, 1.5, size=(2, 4))
  sums = jax.jit(optimization.cross_entropy, static_argnums=3)(
      jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(weights, jnp.float32),
      smoothing)
  want = label_smoothed_loss(logits, targets, weights, smoothing)
  np.testing.assert_allclose(float(sums['loss']), want, rtol=RTOL)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(sums['nll']), (nll * weights).sum(), rtol=RTOL)
  if smoothing:  # The comparison can fail: smoothing changes the loss.
    assert abs(float(sums['loss']) - (nll * weights).sum()) > 1e-2


def test_targets_beyond_the_output_layer_count_as_unk():
  """A model whose output layer covers the training targets' pieces (output_vocab_size)
  scores a validation piece beyond them as UNK: finite, the same sums as with UNK there."""
  rng = np.random.default_rng(8)
  logits = jnp.asarray(rng.normal(size=(2, 4, 9)), jnp.float32)
  targets = rng.integers(3, 9, size=(2, 4))
  beyond = targets.copy()
  beyond[0, 1], beyond[1, 3] = 9, 15
  unk = targets.copy()
  unk[0, 1] = unk[1, 3] = UNK_ID
  weights = jnp.ones((2, 4), jnp.float32)
  got = optimization.cross_entropy(logits, jnp.asarray(beyond), weights, 0.1)
  want = optimization.cross_entropy(logits, jnp.asarray(unk), weights, 0.1)
  plain = optimization.cross_entropy(logits, jnp.asarray(targets), weights, 0.1)
  for key in ('loss', 'nll', 'correct'):
    assert np.isfinite(float(got[key]))
    np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-6)
  assert abs(float(got['nll']) - float(plain['nll'])) > 1e-3


def test_train_step_reports_the_label_smoothed_loss_of_its_config():
  """The compiled train step's loss (the sum it differentiates) is the label-smoothed loss
  with the config's optimizer.label_smoothing (Vaswani et al. 2017, Section 5.4) over the real
  target tokens of the batch, from the model's logits before the update."""
  from configs import tiny
  from nmt import sharding
  config = tiny.get_config()
  config.model.update(vocab_size=20, d_model=16, d_ff=32, max_len=16, dropout_rate=0.0)
  config.optimizer.label_smoothing = 0.2
  model = Transformer(TransformerConfig(**config.model))
  mesh = sharding.make_mesh('', jax.devices()[:1])
  optimizer = optimization.make_optimizer(config)
  init = jax.tree_util.Partial(optimization.init_train_state, model, optimizer)
  shardings = sharding.state_shardings(jax.eval_shape(init, jax.random.key(0)), mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  params = jax.device_get(state['params'])
  rng = np.random.default_rng(9)
  inputs = rng.integers(3, 20, size=(2, 6)).astype(np.int32)
  targets = rng.integers(3, 20, size=(2, 5)).astype(np.int32)
  inputs[1, 4:], targets[1, 3:] = 0, 0
  batch = {'inputs': inputs, 'targets': targets,
           'inputs_segmentation': (inputs > 0).astype(np.int32),
           'targets_segmentation': (targets > 0).astype(np.int32),
           'inputs_positions': np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6)).copy(),
           'targets_positions': np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5)).copy()}
  step_fn, batch_sharding = optimization.compile_train_step(config, model, optimizer, mesh,
                                                            shardings)
  _, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
  logits = jax.jit(model.apply)({'params': params}, inputs, targets)
  weights = (targets > 0).astype(np.float64)
  np.testing.assert_allclose(float(metrics['loss']),
                             label_smoothed_loss(logits, targets, weights, 0.2), rtol=RTOL)
  assert float(metrics['tokens']) == weights.sum()


def schedule_config(width_field: str, width: int, warmup: int, scale: float, cooldown: int,
                    steps: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({
      'model': {width_field: width}, 'num_train_steps': steps,
      'optimizer': {'warmup_steps': warmup, 'learning_rate_scale': scale,
                    'cooldown_fraction': cooldown / steps}})


@pytest.mark.parametrize('width_field, cooldown', [('d_model', 0), ('d_model', 300),
                                                   ('hidden_dim', 0)])
def test_learning_rate_schedule_is_the_papers_formula(width_field, cooldown):
  """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (Vaswani et al.
  2017, Section 5.3, Eq. 3) at step = count + 1 (the RNN's hidden_dim in place of d_model);
  with a cooldown of C = cooldown_fraction * num_train_steps steps, the last C steps of the run
  multiply it by (num_train_steps + 1 - step) / C, which reaches 0 after the last step, as
  nmt/optimization.py documents."""
  width, warmup, scale, steps = 96, 120, 1.7, 1000
  config = schedule_config(width_field, width, warmup, scale, cooldown, steps)
  schedule = optimization.learning_rate_schedule(config)
  counts = np.arange(steps + 5)
  got = np.asarray(schedule(jnp.asarray(counts)), np.float64)
  step = counts + 1.0
  want = scale * width**-0.5 * np.minimum(step**-0.5, step * warmup**-1.5)
  if cooldown:
    want *= np.clip((steps + 1 - step) / cooldown, 0, 1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
  assert got[0] > 0 and got.argmax() == warmup - 1  # The peak is step warmup (count warmup-1).
  if cooldown:
    assert got[steps - 1] > 0 and np.all(got[steps:] == 0)


# --------------------------------------------------------------------------------------------
# Beam search's length penalty (Wu et al. 2016).


def gnmt_penalty(length, alpha):
  """lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha (Wu et al. 2016, Section 7, Eq. 14)."""
  return (5.0 + np.asarray(length, np.float64)) ** alpha / 6.0**alpha


def test_length_penalty_is_the_gnmt_formula():
  """length_penalty(|Y|, alpha) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, Eq. 14)."""
  lengths = np.arange(1, 40)
  for alpha in (0.0, 0.6, 1.0, 2.0):
    np.testing.assert_allclose(np.asarray(length_penalty(lengths, alpha)),
                               gnmt_penalty(lengths, alpha), rtol=1e-6)


def test_beam_search_scores_are_log_probs_over_the_gnmt_penalty():
  """With a beam wide enough to keep every prefix, beam search returns the outputs Y that
  maximise log P(Y | X) / lp(Y), lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, Eq. 14), and
  those scores; |Y| counts the EOS. The model: a bigram table per sentence."""
  vocab, max_length, alpha, nbest = 5, 4, 1.5, 3
  rng = np.random.default_rng(8)
  logits = rng.normal(size=(2, vocab, vocab)) * 3.0
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  table = jnp.asarray(log_probs, jnp.float32)

  def step_fn(tokens, step, cache):  # P(next | previous token), tokens [batch, beam].
    return table[jnp.arange(2)[:, None], tokens], cache

  beam = (vocab - 2) ** (max_length - 1)  # Every prefix stays live.
  seqs, scores = jax.jit(lambda cache: beam_search(
      step_fn, cache, batch_size=2, beam_size=beam, max_length=max_length, alpha=alpha,
      nbest=nbest))(jnp.zeros((2, beam)))
  # Brute force: every output of real tokens (2..vocab-1) ending in EOS.
  outputs = [list(prefix) + [EOS_ID] for n in range(max_length)
             for prefix in itertools.product(range(2, vocab), repeat=n)]
  changed_winner = []
  for b in range(2):
    log_p = np.array([sum(log_probs[b, previous, token] for previous, token in
                          zip([0] + output[:-1], output)) for output in outputs])
    lengths = np.array([len(output) for output in outputs])
    penalised = log_p / gnmt_penalty(lengths, alpha)
    order = np.argsort(-penalised, kind='stable')[:nbest]
    want = np.array([outputs[i] + [0] * (max_length - len(outputs[i])) for i in order])
    np.testing.assert_array_equal(seqs[b], want)
    np.testing.assert_allclose(scores[b], penalised[order], rtol=RTOL, atol=ATOL)
    changed_winner.append(np.argmax(log_p) != order[0])
  assert any(changed_winner)  # Meaningful only if the penalty changes a winner.
