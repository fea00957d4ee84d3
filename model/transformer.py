"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

One class per box of the paper's Figure 1, bottom-up: attention, feed-forward, encoder layer,
decoder layer, encoder, decoder, and the `Transformer` that embeds tokens (with one shared
matrix) and projects the decoder's output to the vocabulary.

Token conventions used everywhere in the project: 0 = padding and decoder start symbol,
1 = end of sentence, 2 = unknown.

Incremental decoding keeps an explicit cache (a plain dict of arrays, passed in and returned):
decoder self-attention keys/values of every step so far, [batch, beam, steps, heads, head_dim],
and the cross-attention keys/values of the encoder output, projected once per source sentence
by `init_decode_cache` and shared by its beams.

`TransformerConfig.cpu_tuned` swaps in CPU-tuned primitives with the same parameters and
results (up to rounding): `cpu_dropout`, `cpu_rows`, `cpu_layer_norm` and `cpu_decoding`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import cpu_decoding, linear_attention, probability_maps
from model.cpu_dropout import HashDropout
from model.cpu_layer_norm import LayerNorm as CpuLayerNorm
from model.cpu_rows import on_rows

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

Array = jax.Array
Cache = dict[str, Any]
# Maps attention logits [..., keys] to attention weights; 'softmax' is the paper's, the others
# give exact zeros (model/probability_maps.py).
ATTENTION_PROBS: dict[str, Callable[[Array], Array]] = {
    'softmax': jax.nn.softmax, 'sparsemax': probability_maps.sparsemax,
    'entmax15': probability_maps.entmax15}
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {'relu': nn.relu, 'gelu': nn.gelu}
# How a query and a key give an attention logit (`MultiHeadAttention.scores`).
ATTENTION_SCORES = ('scaled_dot', 'dot', 'bilinear', 'additive')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Every architectural choice of the model.

  Defaults are the paper's base model; `base()` and `big()` give Table 3's rows. Every field
  can come from JSON: `dtype`/`param_dtype` also take names such as 'bfloat16'.
  """

  vocab_size: int
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  max_len: int = 256  # Longest sequence (per segment) the positional encoding covers.
  share_embeddings: bool = True  # Source, target and output projection share one matrix.
  pre_norm: bool = False  # False: the paper's post-LN; True: LayerNorm before each sub-layer.
  positional: str = 'sinusoidal'  # 'sinusoidal' (the paper) or 'learned'.
  activation: str = 'relu'
  attention_probs: str = 'softmax'  # A key of ATTENTION_PROBS.
  # One of ATTENTION_SCORES: 'scaled_dot' q.k/sqrt(head_dim) (the paper), 'dot' q.k, 'bilinear'
  # q^T W k, 'additive' v^T tanh(q + k) (Bahdanau's, on the projected q and k: memory grows
  # as batch * heads * q_len * k_len * head_dim).
  attention_score: str = 'scaled_dot'
  # Linear attention (model/linear_attention.py) in every attention instead of a probability
  # map of scores; decoding then keeps a constant-size state instead of a growing cache.
  linear_attention: bool = False
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # Compute dtype, e.g. jnp.bfloat16 or 'bfloat16'.
  param_dtype: Any = jnp.float32
  # CPU-tuned primitives (same parameters): None = on when jax.default_backend() is 'cpu'.
  cpu_tuned: bool | None = None
  # `jax.nn.dot_product_attention(implementation=...)`: None or 'xla' (XLA's own lowering,
  # every backend), 'cudnn' (cuDNN's fused kernel, GPU, bf16/fp16 only).
  attention_implementation: str | None = None

  def __post_init__(self):
    for name in ('dtype', 'param_dtype'):  # 'bfloat16' and jnp.bfloat16 alike.
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} is not divisible by num_heads={self.num_heads}.')
    if self.positional not in ('sinusoidal', 'learned'):
      raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {self.positional!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}.')
    if self.attention_probs not in ATTENTION_PROBS:
      raise ValueError(
          f'attention_probs must be one of {sorted(ATTENTION_PROBS)}, '
          f'got {self.attention_probs!r}.')
    if self.attention_score not in ATTENTION_SCORES:
      raise ValueError(f'attention_score must be one of {list(ATTENTION_SCORES)}, '
                       f'got {self.attention_score!r}.')
    if self.linear_attention and (self.attention_probs, self.attention_score) != (
        'softmax', 'scaled_dot'):
      raise ValueError('linear_attention replaces the attention scores and probabilities: leave '
                       "attention_probs='softmax' and attention_score='scaled_dot' with it.")
    if self.linear_attention and self.attention_dropout_rate:
      raise ValueError('linear_attention has no attention weights to drop out: set '
                       'attention_dropout_rate=0.')
    if self.positional == 'sinusoidal' and self.d_model % 2:
      raise ValueError(f'sinusoidal positions need an even d_model, got {self.d_model}.')

  @classmethod
  def base(cls, vocab_size: int, **overrides) -> TransformerConfig:
    """The paper's base model (Table 3): 512/2048/8 heads/6+6 layers/dropout 0.1."""
    return cls(vocab_size=vocab_size, **overrides)

  @classmethod
  def big(cls, vocab_size: int, **overrides) -> TransformerConfig:
    """The paper's big model (Table 3): 1024/4096/16 heads/6+6 layers/dropout 0.3."""
    settings = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return cls(vocab_size=vocab_size, **{**settings, **overrides})

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def use_cpu_tuned(self) -> bool:
    """`cpu_tuned`, with None resolved against the backend (at trace time)."""
    if self.cpu_tuned is None:
      return jax.default_backend() == 'cpu'
    return self.cpu_tuned

  @property
  def use_cpu_decoding(self) -> bool:
    """Decoding with model/cpu_decoding.py's cache (softmax-family attention only)."""
    return self.use_cpu_tuned and not self.linear_attention


def sinusoidal_table(max_len: int, d_model: int) -> np.ndarray:
  """The paper's positional encodings, [max_len, d_model], float32.

  PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(same angle): sines and
  cosines interleaved, not in two halves.
  """
  position = np.arange(max_len, dtype=np.float64)[:, None]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
  angle = position / np.power(10000.0, two_i / d_model)
  table = np.zeros((max_len, d_model), dtype=np.float64)
  table[:, 0::2] = np.sin(angle)
  table[:, 1::2] = np.cos(angle)
  return table.astype(np.float32)


def shift_right(targets: Array, segmentation: Array | None = None) -> Array:
  """Decoder inputs: targets shifted right by one with the start symbol 0, per packed segment.

  Args:
    targets: [batch, length] int.
    segmentation: [batch, length] segment ids of packed rows, or None.
  Returns:
    [batch, length] int, 0 at the start of every segment.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    previous_segment = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segmentation == previous_segment, shifted, PAD_ID)
  return shifted


def positions_from_segmentation(segmentation: Array) -> Array:
  """Position of every token within its packed segment: [batch, length] int32.

  A segment starts wherever the id differs from the previous token's.
  """
  index = jnp.broadcast_to(jnp.arange(segmentation.shape[1], dtype=jnp.int32),
                           segmentation.shape)
  previous = jnp.pad(segmentation, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
  starts = jnp.where(segmentation != previous, index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def attention_mask(query_tokens: Array, key_tokens: Array,
                   query_segmentation: Array | None = None,
                   key_segmentation: Array | None = None,
                   causal: bool = False) -> Array:
  """Boolean mask [batch, 1, query_length, key_length]: True where attention is allowed.

  Blocks padding keys and queries (id 0), attention across packed segments, and with
  `causal` every key after the query.
  """
  mask = (query_tokens > 0)[:, None, :, None] & (key_tokens > 0)[:, None, None, :]
  if query_segmentation is not None:
    mask &= query_segmentation[:, None, :, None] == key_segmentation[:, None, None, :]
  if causal:
    q_len, k_len = query_tokens.shape[1], key_tokens.shape[1]
    mask &= jnp.arange(q_len)[:, None] >= jnp.arange(k_len)[None, :]
  return mask


class LinearMask(NamedTuple):
  """What linear attention needs instead of a [q_len, k_len] mask (model/linear_attention.py).

  query_segments [batch, q_len] and key_segments [batch, k_len] int: 0 at padding, else the
  packed segment id (1 for every token of an unpacked row); `causal` and `packed` as there.
  """

  query_segments: Array
  key_segments: Array
  causal: bool
  packed: bool

  def dense(self) -> Array:
    """The same as a bool mask [batch, 1, q_len, k_len]."""
    query, key = self.query_segments, self.key_segments
    mask = (query[:, None, :, None] == key[:, None, None, :]) & (query > 0)[:, None, :, None]
    if self.causal:
      mask &= jnp.arange(query.shape[1])[:, None] >= jnp.arange(key.shape[1])[None, :]
    return mask


def segment_ids(tokens: Array, segmentation: Array | None) -> Array:
  """[batch, length] int32: 0 at padding, else the token's segment (1 in unpacked rows)."""
  real = tokens > 0
  if segmentation is None:
    return real.astype(jnp.int32)
  return jnp.where(real, segmentation, 0).astype(jnp.int32)


def make_mask(config: TransformerConfig, query_tokens: Array, key_tokens: Array,
              query_segmentation: Array | None = None, key_segmentation: Array | None = None,
              causal: bool = False) -> Array | LinearMask:
  """`attention_mask`, or with `config.linear_attention` its `LinearMask`."""
  if config.linear_attention:
    return LinearMask(segment_ids(query_tokens, query_segmentation),
                      segment_ids(key_tokens, key_segmentation), causal,
                      packed=query_segmentation is not None)
  return attention_mask(query_tokens, key_tokens, query_segmentation, key_segmentation, causal)


# The switchable primitives: the paper's operation, or its CPU-tuned twin.


def dropout(config: TransformerConfig, rate: float) -> nn.Module:
  """Inverted dropout (Section 5.4): `nn.Dropout`, or `HashDropout` when CPU-tuned."""
  return HashDropout(rate) if config.use_cpu_tuned else nn.Dropout(rate)


def layer_norm(config: TransformerConfig) -> nn.Module:
  """Layer normalisation: `nn.LayerNorm`, or its CPU twin (same parameters) when CPU-tuned."""
  norm = CpuLayerNorm if config.use_cpu_tuned else nn.LayerNorm
  return norm(epsilon=config.layer_norm_epsilon, dtype=config.dtype,
              param_dtype=config.param_dtype)


def dense_apply(config: TransformerConfig, layer: Callable[[Array], Array], x: Array,
                feature_dims: int = 1) -> Array:
  """layer(x) on x [batch, length, *features]; on rank-2 rows when CPU-tuned."""
  return on_rows(layer, x, feature_dims) if config.use_cpu_tuned else layer(x)


class MultiHeadAttention(nn.Module):
  """Multi-head scaled dot-product attention (Section 3.2.2), or another score, probability
  map or linear attention as the config chooses."""

  config: TransformerConfig

  def setup(self):
    c = self.config
    project = functools.partial(
        nn.DenseGeneral, features=(c.num_heads, c.head_dim), dtype=c.dtype,
        param_dtype=c.param_dtype, kernel_init=nn.initializers.xavier_uniform())
    self.query = project()
    # No key bias: it adds q.b to every logit of a query alike, which softmax cancels. Its
    # gradient is pure rounding noise, which Adam would scale up into real updates.
    self.key = project(use_bias=False)
    self.value = project()
    self.out = nn.DenseGeneral(
        features=c.d_model, axis=(-2, -1), dtype=c.dtype, param_dtype=c.param_dtype,
        kernel_init=nn.initializers.xavier_uniform())
    self.attention_dropout = dropout(c, c.attention_dropout_rate)
    if c.attention_score == 'bilinear':  # q^T W k per head; starts as the scaled dot-product.
      self.score_kernel = self.param(
          'score_kernel', lambda _, shape, dtype: jnp.broadcast_to(
              jnp.eye(c.head_dim, dtype=dtype) / np.sqrt(c.head_dim), shape),
          (c.num_heads, c.head_dim, c.head_dim), c.param_dtype)
    elif c.attention_score == 'additive':  # v^T tanh(q + k) per head.
      self.score_vector = self.param(
          'score_vector', nn.initializers.normal(stddev=c.head_dim**-0.5),
          (c.num_heads, c.head_dim), c.param_dtype)

  def project_keys_values(self, x: Array) -> tuple[Array, Array]:
    """[batch, length, d_model] -> keys, values [batch, length, heads, head_dim]."""
    return dense_apply(self.config, self.key, x), dense_apply(self.config, self.value, x)

  def score_query(self, query: Array) -> Array:
    """The query that a dot product with the keys turns into logits, for the dot-product
    scores: q/sqrt(head_dim), q, or W^T q (bilinear). query: [..., heads, head_dim]."""
    c = self.config
    if c.attention_score == 'scaled_dot':
      return query / np.sqrt(c.head_dim).astype(query.dtype)
    if c.attention_score == 'bilinear':
      return jnp.einsum('...hd,hde->...he', query, self.score_kernel.astype(query.dtype))
    return query

  def additive_scores(self, query: Array, keys: Array) -> Array:
    """v^T tanh(q + k): query [batch, heads, q_len, head_dim], keys [batch, heads, head_dim,
    k_len] -> float32 logits [batch, heads, q_len, k_len]."""
    hidden = jnp.tanh(query[..., None].astype(jnp.float32) + keys[:, :, None].astype(jnp.float32))
    return jnp.einsum('bhqdk,hd->bhqk', hidden, self.score_vector.astype(jnp.float32))

  def scores(self, query: Array, keys: Array) -> Array:
    """Attention logits, float32 [batch, heads, q_len, k_len].

    Args:
      query: [batch, q_len, heads, head_dim], projected.
      keys: [batch, k_len, heads, head_dim], projected.
    """
    if self.config.attention_score == 'additive':
      return self.additive_scores(query.transpose(0, 2, 1, 3), keys.transpose(0, 2, 3, 1))
    return jnp.einsum('bqhd,bkhd->bhqk', self.score_query(query), keys,
                      preferred_element_type=jnp.float32)

  def attend(self, x: Array, keys: Array, values: Array, mask: Array | LinearMask,
             train: bool) -> Array:
    """Queries from x [batch, q_len, d_model] attend to projected keys/values.

    Args:
      x: [batch, q_len, d_model].
      keys, values: [batch, k_len, heads, head_dim].
      mask: bool, broadcastable to [batch, heads, q_len, k_len] (`LinearMask` with linear
        attention).
      train: enables attention dropout.
    Returns:
      [batch, q_len, d_model].
    """
    c = self.config
    query = dense_apply(c, self.query, x)
    use_dropout = train and c.attention_dropout_rate > 0
    # apply(..., mutable=['intermediates']) records every attention's weights as
    # 'attention_weights' [batch, heads, q_len, k_len] (plot_attention.py draws them).
    record = self.is_mutable_collection('intermediates')
    if c.linear_attention:
      context = linear_attention.attention(query, keys, values, *mask).astype(c.dtype)
      if record:
        self.sow('intermediates', 'attention_weights',
                 linear_attention.weights(query, keys, mask.dense()))
    elif (c.attention_probs == 'softmax' and c.attention_score == 'scaled_dot' and
          not use_dropout and not record):
      # Logits and softmax in float32 for any input dtype. implementation=None is XLA's own
      # lowering of the same einsums on every backend; 'cudnn' selects cuDNN's fused kernel
      # (GPU, bf16/fp16 inputs only).
      context = jax.nn.dot_product_attention(query, keys, values, mask=mask,
                                             implementation=c.attention_implementation)
    else:
      weights = self.weights(self.scores(query, keys), mask)
      if record:
        self.sow('intermediates', 'attention_weights', weights)
      weights = self.attention_dropout(weights, deterministic=not use_dropout)
      context = jnp.einsum('bhqk,bkhd->bqhd', weights, values)
    return dense_apply(c, self.out, context, feature_dims=2)

  def weights(self, logits: Array, mask: Array) -> Array:
    """Attention probabilities [batch, heads, q_len, k_len] from float32 logits, in float32,
    returned in the compute dtype."""
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = ATTENTION_PROBS[self.config.attention_probs](logits.astype(jnp.float32))
    return probs.astype(self.config.dtype)

  def cached_step(self, x: Array, step: Array, keys: Array, values: Array,
                  mask: Array) -> tuple[Array, Array, Array]:
    """Self-attention of one decoding step with a key/value cache.

    Args:
      x: [batch, beam, d_model], this step's inputs of every hypothesis.
      step: scalar int, the position being decoded.
      keys, values: the cache, [batch, beam, steps, heads, head_dim].
      mask: [1, 1, 1, steps] bool, the steps written so far (this one included).
    Returns:
      [batch, beam, d_model] and the cache with this step's keys/values written.
    """
    new_keys, new_values = self.project_keys_values(x)  # [batch, beam, heads, head_dim]
    keys = jax.lax.dynamic_update_slice_in_dim(keys, new_keys[:, :, None], step, axis=2)
    values = jax.lax.dynamic_update_slice_in_dim(values, new_values[:, :, None], step, axis=2)
    batch, beam = x.shape[:2]
    rows = lambda t: t.reshape((batch * beam,) + t.shape[2:])  # Hypotheses as the batch.
    out = self.attend(rows(x)[:, None], rows(keys), rows(values), mask, train=False)
    return out.reshape(x.shape), keys, values

  def linear_step(self, x: Array, state: Array) -> tuple[Array, Array]:
    """Linear self-attention of one decoding step: adds its key/value to the state, then reads.

    Args:
      x: [batch, beam, d_model], this step's inputs of every hypothesis.
      state: [batch, beam, heads, head_dim, head_dim + 1] (model/linear_attention.py).
    Returns:
      [batch, beam, d_model] and the new state.
    """
    keys, values = self.project_keys_values(x)
    state = linear_attention.add_to_state(state, keys, values)
    return self.linear_read(x, state), state

  def linear_read(self, x: Array, state: Array) -> Array:
    """Linear attention of x [batch, beam, d_model] over a summed state: [batch, beam, heads,
    head_dim, head_dim + 1] (self-attention) or [batch, heads, ...] (the source's, shared)."""
    c = self.config
    if state.ndim == 4:
      state = state[:, None]
    context = linear_attention.read(dense_apply(c, self.query, x), state).astype(c.dtype)
    return dense_apply(c, self.out, context, feature_dims=2)

  def __call__(self, x: Array, context: Array, mask: Array | LinearMask, train: bool) -> Array:
    keys, values = self.project_keys_values(context)
    return self.attend(x, keys, values, mask, train)


class FeedForward(nn.Module):
  """Position-wise feed-forward network, max(0, x W1 + b1) W2 + b2 (Section 3.3)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """[batch, length, d_model] -> [batch, length, d_model]."""
    c = self.config
    dense = functools.partial(nn.Dense, dtype=c.dtype, param_dtype=c.param_dtype,
                              kernel_init=nn.initializers.xavier_uniform())
    feed_forward = lambda rows: dense(c.d_model, name='output')(
        ACTIVATIONS[c.activation](dense(c.d_ff, name='hidden')(rows)))
    return dense_apply(c, feed_forward, x)


class SublayerConnection(nn.Module):
  """LayerNorm(x + Dropout(sublayer(x))) (post-LN, the paper) or x + Dropout(sublayer(LN(x)))."""

  config: TransformerConfig

  def setup(self):
    self.norm = layer_norm(self.config)
    self.dropout = dropout(self.config, self.config.dropout_rate)

  def __call__(self, x: Array, sublayer: Callable[[Array], Array], train: bool) -> Array:
    if self.config.pre_norm:
      return x + self.dropout(sublayer(self.norm(x)), deterministic=not train)
    return self.norm(x + self.dropout(sublayer(x), deterministic=not train))


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each wrapped in a residual sub-layer connection."""

  config: TransformerConfig

  def setup(self):
    self.self_attention = MultiHeadAttention(self.config)
    self.self_attention_sublayer = SublayerConnection(self.config)
    self.feed_forward = FeedForward(self.config)
    self.feed_forward_sublayer = SublayerConnection(self.config)

  def __call__(self, x: Array, mask: Array, train: bool) -> Array:
    """x: [batch, length, d_model]; mask: [batch, 1, length, length]."""
    x = self.self_attention_sublayer(x, lambda y: self.self_attention(y, y, mask, train), train)
    return self.feed_forward_sublayer(x, self.feed_forward, train)


class DecoderLayer(nn.Module):
  """Masked self-attention, attention over the encoder output, then feed-forward."""

  config: TransformerConfig

  def setup(self):
    self.self_attention = MultiHeadAttention(self.config)
    self.self_attention_sublayer = SublayerConnection(self.config)
    self.cross_attention = MultiHeadAttention(self.config)
    self.cross_attention_sublayer = SublayerConnection(self.config)
    self.feed_forward = FeedForward(self.config)
    self.feed_forward_sublayer = SublayerConnection(self.config)

  def __call__(self, y: Array, encoded: Array, self_mask: Array, cross_mask: Array,
               train: bool) -> Array:
    """Teacher-forced pass. y: [batch, tgt_len, d_model]; encoded: [batch, src_len, d_model]."""
    y = self.self_attention_sublayer(
        y, lambda z: self.self_attention(z, z, self_mask, train), train)
    y = self.cross_attention_sublayer(
        y, lambda z: self.cross_attention(z, encoded, cross_mask, train), train)
    return self.feed_forward_sublayer(y, self.feed_forward, train)

  def step(self, y: Array, step: Array, layer_cache: Cache, self_mask: Array,
           cross_mask: Array) -> tuple[Array, Cache]:
    """One incremental decoding step for `beam` hypotheses per sentence.

    Args:
      y: [batch, beam, d_model], the embedded tokens of this step.
      step: scalar int, the position being decoded.
      layer_cache: this layer's part of `Transformer.init_decode_cache`'s cache.
      self_mask: which cached self-attention entries each hypothesis sees.
      cross_mask: [batch, 1, 1, src_len] bool.
    Returns:
      [batch, beam, d_model] and the updated layer cache.
    """
    new_cache = dict(layer_cache)
    cpu_tuned = self.config.use_cpu_decoding
    if self.config.linear_attention:
      return self.linear_step(y, layer_cache)

    def self_attend(z):
      if cpu_tuned:
        out, written = cpu_decoding.self_attention_step(
            self.self_attention, z, step, layer_cache, self_mask)
        new_cache.update(written)
      else:
        out, new_cache['self_keys'], new_cache['self_values'] = self.self_attention.cached_step(
            z, step, layer_cache['self_keys'], layer_cache['self_values'], self_mask)
      return out

    y = self.self_attention_sublayer(y, self_attend, False)
    # The beam axis plays the query axis of cross-attention: one source, `beam` queries, so the
    # encoder keys/values are neither copied per hypothesis nor reordered.
    if cpu_tuned:
      cross_attend = lambda z: cpu_decoding.cross_attention_step(
          self.cross_attention, z, layer_cache, cross_mask)
    else:
      cross_attend = lambda z: self.cross_attention.attend(
          z, layer_cache['cross_keys'], layer_cache['cross_values'], cross_mask, False)
    y = self.cross_attention_sublayer(y, cross_attend, False)
    return self.feed_forward_sublayer(y, self.feed_forward, False), new_cache

  def linear_step(self, y: Array, layer_cache: Cache) -> tuple[Array, Cache]:
    """`step` with linear attention: layer_cache holds 'self_state' and 'cross_state'."""
    new_cache = dict(layer_cache)

    def self_attend(z):
      out, new_cache['self_state'] = self.self_attention.linear_step(z, layer_cache['self_state'])
      return out

    y = self.self_attention_sublayer(y, self_attend, False)
    y = self.cross_attention_sublayer(
        y, lambda z: self.cross_attention.linear_read(z, layer_cache['cross_state']), False)
    return self.feed_forward_sublayer(y, self.feed_forward, False), new_cache


class Encoder(nn.Module):
  """The stack of encoder layers (and, pre-LN, a final LayerNorm) over embedded sources."""

  config: TransformerConfig

  def setup(self):
    self.layers = [EncoderLayer(self.config) for _ in range(self.config.num_encoder_layers)]
    if self.config.pre_norm:  # Pre-LN leaves the residual stream unnormalised.
      self.norm = layer_norm(self.config)

  def __call__(self, x: Array, mask: Array, train: bool = False) -> Array:
    """x: [batch, src_len, d_model] embedded; mask: [batch, 1, src_len, src_len] -> encoded."""
    for layer in self.layers:
      x = layer(x, mask, train)
    return self.norm(x) if self.config.pre_norm else x


class Decoder(nn.Module):
  """The stack of decoder layers (and, pre-LN, a final LayerNorm) over embedded targets."""

  config: TransformerConfig

  def setup(self):
    self.layers = [DecoderLayer(self.config) for _ in range(self.config.num_decoder_layers)]
    if self.config.pre_norm:
      self.norm = layer_norm(self.config)

  def __call__(self, y: Array, encoded: Array, self_mask: Array, cross_mask: Array,
               train: bool = False) -> Array:
    """y: [batch, tgt_len, d_model] embedded decoder inputs -> [batch, tgt_len, d_model]."""
    for layer in self.layers:
      y = layer(y, encoded, self_mask, cross_mask, train)
    return self.norm(y) if self.config.pre_norm else y

  def cross_keys_values(self, encoded: Array) -> list[tuple[Array, Array]]:
    """Per layer, cross-attention keys, values [batch, src_len, heads, head_dim]."""
    return [layer.cross_attention.project_keys_values(encoded) for layer in self.layers]

  def step(self, y: Array, step: Array, layer_caches: list[Cache], self_mask: Array,
           cross_mask: Array) -> tuple[Array, list[Cache]]:
    """One decoding step (see `DecoderLayer.step`): [batch, beam, d_model], new caches."""
    new_caches = []
    for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
      y, layer_cache = layer.step(y, step, layer_cache, self_mask, cross_mask)
      new_caches.append(layer_cache)
    return (self.norm(y) if self.config.pre_norm else y), new_caches


class Transformer(nn.Module):
  """Encoder-decoder Transformer.

  `__call__` returns logits [batch, target_length, vocab] predicting `targets` (teacher forcing);
  `encode`, `decode`, `init_decode_cache` and `decode_step` are the pieces for decoding.
  """

  config: TransformerConfig

  def setup(self):
    c = self.config
    embed = functools.partial(
        nn.Embed, num_embeddings=c.vocab_size, features=c.d_model, dtype=c.dtype,
        param_dtype=c.param_dtype, embedding_init=nn.initializers.normal(stddev=c.d_model**-0.5))
    if c.share_embeddings:
      self.embed = embed()
    else:
      self.source_embed = embed()
      self.target_embed = embed()
      # Logits in float32 whatever the compute dtype.
      self.output_projection = nn.Dense(
          c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
          kernel_init=nn.initializers.xavier_uniform(),
          dot_general=functools.partial(jax.lax.dot_general,
                                        preferred_element_type=jnp.float32))
    if c.positional == 'learned':
      self.position_embed = nn.Embed(
          c.max_len, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
          embedding_init=nn.initializers.normal(stddev=0.02))
    self.embedding_dropout = dropout(c, c.dropout_rate)
    self.encoder = Encoder(c)
    self.decoder = Decoder(c)

  def _embed(self, tokens: Array, positions: Array, source: bool, train: bool) -> Array:
    """Token embedding * sqrt(d_model) + positional encoding, then dropout. -> [..., d_model]."""
    c = self.config
    if c.share_embeddings:
      table = self.embed
    else:
      table = self.source_embed if source else self.target_embed
    x = table(tokens) * jnp.sqrt(jnp.asarray(c.d_model, c.dtype))
    if c.positional == 'sinusoidal':
      x = x + jnp.asarray(sinusoidal_table(c.max_len, c.d_model), c.dtype)[positions]
    else:
      x = x + self.position_embed(positions)
    return self.embedding_dropout(x, deterministic=not train)

  def _logits(self, y: Array) -> Array:
    """[..., d_model] -> float32 logits [..., vocab] through the (shared) embedding matrix."""
    c = self.config
    if c.share_embeddings:
      embedding = self.embed.embedding.astype(c.dtype)
      project = lambda rows: jnp.einsum('...d,vd->...v', rows.astype(c.dtype), embedding,
                                        preferred_element_type=jnp.float32)
    else:
      project = self.output_projection
    return dense_apply(c, project, y).astype(jnp.float32)

  def _check_length(self, length: int, what: str):
    if length > self.config.max_len:
      raise ValueError(f'{what} length {length} exceeds TransformerConfig.max_len='
                       f'{self.config.max_len}; raise max_len or truncate the input.')

  def encode(self, inputs: Array, inputs_segmentation: Array | None = None,
             inputs_positions: Array | None = None, train: bool = False) -> Array:
    """inputs: [batch, src_len] int -> encoded [batch, src_len, d_model].

    Positions default to each token's position within its segment (or row).
    """
    self._check_length(inputs.shape[1], 'Source')
    if inputs_positions is None:
      inputs_positions = _default_positions(inputs, inputs_segmentation)
    mask = make_mask(self.config, inputs, inputs, inputs_segmentation, inputs_segmentation)
    x = self._embed(inputs, inputs_positions, source=True, train=train)
    return self.encoder(x, mask, train)

  def decode(self, encoded: Array, inputs: Array, targets: Array,
             inputs_segmentation: Array | None = None,
             targets_segmentation: Array | None = None,
             targets_positions: Array | None = None, train: bool = False) -> Array:
    """Teacher-forced decoder: logits [batch, tgt_len, vocab] (float32) predicting `targets`.

    Args:
      encoded: [batch, src_len, d_model] from `encode`.
      inputs: [batch, src_len] source ids (for the padding/segment mask).
      targets: [batch, tgt_len] target ids; the decoder reads them shifted right.
    """
    self._check_length(targets.shape[1], 'Target')
    if targets_positions is None:
      targets_positions = _default_positions(targets, targets_segmentation)
    decoder_inputs = shift_right(targets, targets_segmentation)
    # Masks come from `targets`, not the decoder inputs: the start symbol shares id 0 with pad.
    self_mask = make_mask(self.config, targets, targets, targets_segmentation,
                          targets_segmentation, causal=True)
    cross_mask = make_mask(self.config, targets, inputs, targets_segmentation,
                           inputs_segmentation)
    y = self._embed(decoder_inputs, targets_positions, source=False, train=train)
    return self._logits(self.decoder(y, encoded, self_mask, cross_mask, train))

  def __call__(self, inputs: Array, targets: Array, *,
               inputs_segmentation: Array | None = None,
               targets_segmentation: Array | None = None,
               inputs_positions: Array | None = None,
               targets_positions: Array | None = None,
               train: bool = False) -> Array:
    """inputs [batch, src_len], targets [batch, tgt_len] -> logits [batch, tgt_len, vocab]."""
    if (inputs_segmentation is None) != (targets_segmentation is None):
      raise ValueError('Packed batches need both inputs_segmentation and targets_segmentation '
                       '(or neither, for one pair per row).')
    encoded = self.encode(inputs, inputs_segmentation, inputs_positions, train)
    return self.decode(encoded, inputs, targets, inputs_segmentation, targets_segmentation,
                       targets_positions, train)

  def init_decode_cache(self, encoded: Array, inputs: Array, beam_size: int,
                        max_length: int) -> Cache:
    """The decoding cache for `beam_size` hypotheses per source sentence.

    Cross-attention keys/values are projected here, once per sentence, and shared by its beams.

    Args:
      encoded: [batch, src_len, d_model] from `encode`.
      inputs: [batch, src_len] source ids (0 = padding).
      beam_size: hypotheses per sentence (1 for greedy search).
      max_length: number of decoding steps the cache holds.
    Returns:
      {'encoder_mask': [batch, src_len] bool, 'layers': per decoder layer 'self_keys',
      'self_values' [batch, beam, max_length, heads, head_dim] and 'cross_keys',
      'cross_values' [batch, src_len, heads, head_dim]}; CPU-tuned, `cpu_decoding.init_cache`'s
      layout; with linear attention 'self_state' [batch, beam, heads, head_dim, head_dim + 1]
      and 'cross_state' [batch, heads, head_dim, head_dim + 1], whatever `max_length`.
    """
    self._check_length(max_length, 'Decoding')
    c = self.config
    cross = self.decoder.cross_keys_values(encoded)
    if c.linear_attention:
      self_state = linear_attention.initial_state((inputs.shape[0], beam_size), c.num_heads,
                                                  c.head_dim)
      layers = [dict(self_state=self_state,
                     cross_state=linear_attention.summed_state(keys, values, inputs > 0))
                for keys, values in cross]
      return {'encoder_mask': inputs > 0, 'layers': layers}
    if c.use_cpu_decoding:
      return cpu_decoding.init_cache(cross, inputs > 0, beam_size, max_length, c.num_heads,
                                     c.head_dim, c.dtype)
    empty = jnp.zeros((inputs.shape[0], beam_size, max_length, c.num_heads, c.head_dim),
                      c.dtype)
    layers = [dict(self_keys=empty, self_values=empty, cross_keys=keys, cross_values=values)
              for keys, values in cross]
    return {'encoder_mask': inputs > 0, 'layers': layers}

  def decode_step(self, tokens: Array, step: Array, cache: Cache) -> tuple[Array, Cache]:
    """Logits for the next token of every hypothesis, given this step's tokens.

    Args:
      tokens: [batch, beam] int, the tokens at position `step` (0 = start symbol at step 0).
      step: scalar int32, the position being decoded; with the CPU decoding cache also
        [batch] int32, a position per sentence (`model/continuous_batching.py`).
      cache: from `init_decode_cache` or the previous step.
    Returns:
      logits [batch, beam, vocab] float32 and the updated cache.
    """
    if self.config.linear_attention:
      self_mask = None  # The states hold exactly what each hypothesis reads.
    elif self.config.use_cpu_decoding:
      self_mask, cache = cpu_decoding.self_attention_mask(cache, step)
    else:
      steps = cache['layers'][0]['self_keys'].shape[2]
      self_mask = (jnp.arange(steps) <= step)[None, None, None, :]
    cross_mask = cache['encoder_mask'][:, None, None, :]
    positions = jnp.broadcast_to(jnp.reshape(step, (-1, 1)), tokens.shape).astype(jnp.int32)
    y = self._embed(tokens, positions, source=False, train=False)
    y, layers = self.decoder.step(y, step, cache['layers'], self_mask, cross_mask)
    return self._logits(y), {**cache, 'layers': layers}


def _default_positions(tokens: Array, segmentation: Array | None) -> Array:
  """Positions within each packed segment, or 0, 1, ... along each row: [batch, length]."""
  if segmentation is not None:
    return positions_from_segmentation(segmentation)
  return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


def upgrade_params(params: dict[str, Any]) -> dict[str, Any]:
  """A parameter tree of the earlier layout (layers at the top level: 'encoder_layers_0', ...,
  'encoder_norm', 'decoder_norm') in today's ('encoder': {'layers_0', ..., 'norm'}, 'decoder':
  ...). Trees already in today's layout are returned unchanged."""
  if 'encoder' in params or 'decoder' in params:
    return params
  upgraded: dict[str, Any] = {}
  for name, value in params.items():
    for side in ('encoder', 'decoder'):
      if name.startswith(f'{side}_layers_'):
        upgraded.setdefault(side, {})['layers_' + name[len(f'{side}_layers_'):]] = value
        break
      if name == f'{side}_norm':
        upgraded.setdefault(side, {})['norm'] = value
        break
    else:
      upgraded[name] = value
  return upgraded


def count_params(params) -> int:
  """Number of scalars in a parameter tree."""
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
