"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

One class per box of the paper's Figure 1, bottom-up: attention, feed-forward, encoder layer,
decoder layer, encoder, decoder, and the `Transformer` that ties the embeddings together.

Token conventions used everywhere in the project: 0 = padding and decoder start symbol,
1 = end of sentence, 2 = unknown.

Incremental decoding keeps an explicit cache (a plain dict of arrays, passed in and returned):
decoder self-attention keys/values of every step so far, and the cross-attention keys/values of
the encoder output, projected once per source sentence by `init_decode_cache`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

Array = jax.Array
# Maps attention logits [..., keys] to attention weights; 'softmax' is the paper's.
ATTENTION_PROBS: dict[str, Callable[[Array], Array]] = {'softmax': jax.nn.softmax}
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {'relu': nn.relu, 'gelu': nn.gelu}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Every architectural choice of the model.

  Defaults are the paper's base model; `base()` and `big()` give Table 3's rows.
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
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # Compute dtype, e.g. jnp.bfloat16 or 'bfloat16'.
  param_dtype: Any = jnp.float32
  cpu_tuned: bool | None = None
  attention_implementation: str | None = None

  def __post_init__(self):
    for name in ('dtype', 'param_dtype'):  # Names, as configs hold them, or dtypes.
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)).type)
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


def _mix32(h: Array) -> Array:
  """MurmurHash3's 32-bit finaliser: a bijection on uint32 with full avalanche."""
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def dropout_keep_mask(key: Array, shape: tuple[int, ...], keep_prob: float) -> Array:
  """A bool mask of `shape` whose entries are True with probability keep_prob, independently.

  Counter-based: each entry hashes its flat index with 64 bits drawn from `key` (two rounds of
  MurmurHash3's finaliser), so one mask costs ~12 integer ops per entry where threefry
  (`jax.random.bernoulli`) costs over 100: dropout took ~23% of the benchmark's CPU training
  step with threefry and ~5% with this (BENCHMARKS.md). The index comes from iotas, so a
  sharded mask is the same however the array is split over devices. Arrays past 2**32 entries
  reuse indices.
  """
  seed = jax.random.bits(key, (2,), jnp.uint32)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride = stride * shape[axis] % 2**32
  bits = _mix32(_mix32(index ^ seed[0]) ^ seed[1])
  return bits < jnp.uint32(min(round(keep_prob * 2**32), 2**32 - 1))


def on_rows(layer: Callable[[Array], Array], x: Array, feature_dims: int = 1) -> Array:
  """layer(x) on x's leading (batch, position) axes flattened into one row axis.

  x: [..., *features] with `feature_dims` feature axes -> layer's output with x's leading axes.
  Rank-2 products are what XLA:CPU's matmul libraries take as they are: on [batch, length,
  features] arrays it transposes activations and gradients to compute each weight gradient
  (14-16% of the benchmark's CPU training step).
  """
  leading = x.shape[:x.ndim - feature_dims]
  y = layer(x.reshape((-1,) + x.shape[x.ndim - feature_dims:]))
  return y.reshape(leading + y.shape[1:])


class Dropout(nn.Module):
  """Inverted dropout (Section 5.4): zero each entry with probability `rate`, scale the rest.

  Uses `dropout_keep_mask` with the 'dropout' RNG stream, like `nn.Dropout`'s interface.
  """

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    keep_prob = 1.0 - self.rate
    # No mask is stored: XLA fuses the hash into the ops that apply it, forward and backward,
    # where its few integer ops cost less than writing and reading a mask would.
    keep = dropout_keep_mask(self.make_rng('dropout'), x.shape, keep_prob)
    return jnp.where(keep, x / keep_prob, 0).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
  """(x - mean) / sqrt(var + epsilon) * scale + bias over the last axis; statistics in float32.

  x: [..., features]; scale, bias: [features]. Returns x's shape and dtype. The gradient is
  written out (`_layer_norm_backward`): XLA's derivative of the same forward made more passes
  over the activations, and a hand-written one made the CPU training step 1.5% faster.
  """
  return _layer_norm_forward(x, scale, bias, epsilon)[0]


def _layer_norm_forward(x, scale, bias, epsilon):
  x32 = x.astype(jnp.float32)
  centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
  normalised = centred * inv_std
  y = normalised * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype), (normalised, inv_std, scale)


def _layer_norm_backward(epsilon, residuals, dy):
  del epsilon
  normalised, inv_std, scale = residuals
  x_dtype = dy.dtype  # The output has the input's dtype.
  dy = dy.astype(jnp.float32)
  d_normalised = dy * scale.astype(jnp.float32)
  # d/dx of (x - mean) * inv_std: remove the mean of the incoming gradient and its component
  # along the normalised input (both are per row, over the feature axis).
  dx = inv_std * (d_normalised - jnp.mean(d_normalised, axis=-1, keepdims=True)
                  - normalised * jnp.mean(d_normalised * normalised, axis=-1, keepdims=True))
  rows = tuple(range(dy.ndim - 1))
  return (dx.astype(x_dtype), jnp.sum(dy * normalised, axis=rows).astype(scale.dtype),
          jnp.sum(dy, axis=rows).astype(scale.dtype))


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


class LayerNorm(nn.Module):
  """Layer normalisation (Ba et al., 2016) with a learned scale and bias, as `nn.LayerNorm`.

  Same parameters ('scale' ones, 'bias' zeros) and results as `nn.LayerNorm`; the
  computation is `layer_norm`.
  """

  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = x.shape[-1]
    scale = self.param('scale', nn.initializers.ones, (features,), self.param_dtype)
    bias = self.param('bias', nn.initializers.zeros, (features,), self.param_dtype)
    # Normalise in the wider of the two dtypes, like nn.LayerNorm; return self.dtype.
    x = x.astype(jnp.promote_types(x.dtype, self.dtype))
    return layer_norm(x, scale, bias, self.epsilon).astype(self.dtype)


class MultiHeadAttention(nn.Module):
  """Multi-head scaled dot-product attention (Section 3.2.2)."""

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
    self.attention_dropout = Dropout(c.attention_dropout_rate)

  def project_keys_values(self, x: Array) -> tuple[Array, Array]:
    """[batch, length, d_model] -> keys, values [batch, length, heads, head_dim]."""
    return on_rows(self.key, x), on_rows(self.value, x)

  def attend(self, x: Array, keys: Array, values: Array, mask: Array, train: bool) -> Array:
    """Queries from x [batch, q_len, d_model] attend to projected keys/values.

    Args:
      x: [batch, q_len, d_model].
      keys, values: [batch, k_len, heads, head_dim].
      mask: bool, broadcastable to [batch, heads, q_len, k_len].
      train: enables attention dropout.
    Returns:
      [batch, q_len, d_model].
    """
    c = self.config
    query = on_rows(self.query, x)
    use_dropout = train and c.attention_dropout_rate > 0
    if c.attention_probs == 'softmax' and not use_dropout:
      # One fused call: cuDNN/flash kernels on GPU, XLA's fusion on CPU/TPU.
      context = jax.nn.dot_product_attention(query, keys, values, mask=mask)
    else:
      logits = jnp.einsum('bqhd,bkhd->bhqk', query, keys) / np.sqrt(c.head_dim).astype(c.dtype)
      weights = self.attention_dropout(self._weights(logits, mask),
                                       deterministic=not use_dropout)
      context = jnp.einsum('bhqk,bkhd->bqhd', weights, values)
    return on_rows(self.out, context, feature_dims=2)

  def _weights(self, logits: Array, mask: Array) -> Array:
    """Attention probabilities [batch, heads, q_len, k_len] from masked logits."""
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = ATTENTION_PROBS[self.config.attention_probs](logits.astype(jnp.float32))
    return probs.astype(self.config.dtype)

  def attend_transposed(self, x: Array, keys_t: Array, values_t: Array, mask: Array) -> Array:
    """`attend` (no dropout) over keys and values stored as [batch, heads, head_dim, k_len].

    That is the layout both of XLA:CPU's attention dot products read, so decoding keeps its
    self-attention cache this way: no step transposes the cache (that took ~13% of a
    beam-search step). Returns [batch, q_len, d_model] for x [batch, q_len, d_model].
    """
    c = self.config
    # [batch, q_len, heads, head_dim]
    query = on_rows(self.query, x) / np.sqrt(c.head_dim).astype(c.dtype)
    logits = jnp.einsum('bhqd,bhdk->bhqk', query.transpose(0, 2, 1, 3), keys_t)
    context = jnp.einsum('bhdk,bhqk->bhdq', values_t, self._weights(logits, mask))
    return on_rows(self.out, context.transpose(0, 3, 1, 2), feature_dims=2)

  def __call__(self, x: Array, context: Array, mask: Array, train: bool) -> Array:
    keys, values = self.project_keys_values(context)
    return self.attend(x, keys, values, mask, train)


class FeedForward(nn.Module):
  """Position-wise feed-forward network, max(0, x W1 + b1) W2 + b2 (Section 3.3)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    dense = functools.partial(nn.Dense, dtype=c.dtype, param_dtype=c.param_dtype,
                              kernel_init=nn.initializers.xavier_uniform())
    feed_forward = lambda rows: dense(c.d_model, name='output')(
        ACTIVATIONS[c.activation](dense(c.d_ff, name='hidden')(rows)))
    return on_rows(feed_forward, x)


class SublayerConnection(nn.Module):
  """LayerNorm(x + Dropout(sublayer(x))) (post-LN, the paper) or x + Dropout(sublayer(LN(x)))."""

  config: TransformerConfig

  def setup(self):
    c = self.config
    self.norm = LayerNorm(epsilon=c.layer_norm_epsilon, dtype=c.dtype, param_dtype=c.param_dtype)
    self.dropout = Dropout(c.dropout_rate)

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

  def cross_keys_values(self, encoded: Array) -> tuple[Array, Array]:
    """Encoder-side keys/values, computed once per source sentence: [batch, src_len, heads, hd]."""
    return self.cross_attention.project_keys_values(encoded)

  def step(self, y: Array, step: Array, layer_cache: dict[str, Array], self_mask: Array,
           cross_mask: Array) -> tuple[Array, dict[str, Array]]:
    """One incremental decoding step for `beam` hypotheses per sentence.

    Args:
      y: [batch, beam, d_model], the embedded tokens of this step.
      step: scalar int, the position being decoded.
      layer_cache: 'self_keys'/'self_values' [batch, heads, head_dim, max_decode_len * beam]
        (entry t * beam + s: step t of slot s) and 'cross_keys'/'cross_values' [batch,
        src_len, heads, head_dim].
      self_mask: [batch, 1, beam, max_decode_len * beam] bool: which cached entries each
        hypothesis sees (its own ancestors' slots at steps <= `step`).
      cross_mask: [batch, 1, 1, src_len] bool.
    Returns:
      [batch, beam, d_model] and the updated layer cache.
    """
    new_cache = dict(layer_cache)

    def self_attend(z):
      keys, values = self.self_attention.project_keys_values(z)  # [batch, beam, heads, hd]
      beam = keys.shape[1]
      # This step's entries of all slots are contiguous: one in-place update, and the cache is
      # read as it is stored (a reshaped view made XLA copy the whole cache every step).
      for name, new in (('self_keys', keys), ('self_values', values)):
        new_cache[name] = jax.lax.dynamic_update_slice_in_dim(
            layer_cache[name], new.transpose(0, 2, 3, 1), step * beam, axis=3)
      # Every hypothesis attends over all beams' cached entries; the mask keeps its own
      # ancestry. This replaces reordering the whole cache after each beam-search step by a
      # small int index, at the price of beam-times more (cheap) attention logits.
      return self.self_attention.attend_transposed(
          z, new_cache['self_keys'], new_cache['self_values'], self_mask)

    y = self.self_attention_sublayer(y, self_attend, False)
    # The beam axis plays the query axis of cross-attention: one source, `beam` queries, so the
    # encoder keys/values are neither copied per hypothesis nor reordered.
    y = self.cross_attention_sublayer(
        y, lambda z: self.cross_attention.attend(
            z, layer_cache['cross_keys'], layer_cache['cross_values'], cross_mask, False), False)
    return self.feed_forward_sublayer(y, self.feed_forward, False), new_cache


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
      self.output_projection = nn.Dense(
          c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
          kernel_init=nn.initializers.xavier_uniform())
    if c.positional == 'learned':
      self.position_embed = nn.Embed(
          c.max_len, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
          embedding_init=nn.initializers.normal(stddev=0.02))
    self.embedding_dropout = Dropout(c.dropout_rate)
    self.encoder_layers = [EncoderLayer(c) for _ in range(c.num_encoder_layers)]
    self.decoder_layers = [DecoderLayer(c) for _ in range(c.num_decoder_layers)]
    if c.pre_norm:  # Pre-LN leaves the residual stream unnormalised: normalise the outputs.
      norm = functools.partial(LayerNorm, epsilon=c.layer_norm_epsilon, dtype=c.dtype,
                               param_dtype=c.param_dtype)
      self.encoder_norm = norm()
      self.decoder_norm = norm()

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
    if self.config.pre_norm:
      y = self.decoder_norm(y)
    if self.config.share_embeddings:
      logits = on_rows(self.embed.attend, y)
    else:
      logits = on_rows(self.output_projection, y)
    return logits.astype(jnp.float32)

  def _check_length(self, length: int, what: str):
    if length > self.config.max_len:
      raise ValueError(f'{what} length {length} exceeds TransformerConfig.max_len='
                       f'{self.config.max_len}; raise max_len or truncate the input.')

  def encode(self, inputs: Array, inputs_segmentation: Array | None = None,
             inputs_positions: Array | None = None, train: bool = False) -> Array:
    """inputs: [batch, src_len] int -> encoded [batch, src_len, d_model]."""
    self._check_length(inputs.shape[1], 'Source')
    if inputs_positions is None:
      inputs_positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    mask = attention_mask(inputs, inputs, inputs_segmentation, inputs_segmentation)
    x = self._embed(inputs, inputs_positions, source=True, train=train)
    for layer in self.encoder_layers:
      x = layer(x, mask, train)
    if self.config.pre_norm:
      x = self.encoder_norm(x)
    return x

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
      targets_positions = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
    decoder_inputs = shift_right(targets, targets_segmentation)
    # Masks come from `targets`, not the decoder inputs: the start symbol shares id 0 with pad.
    self_mask = attention_mask(targets, targets, targets_segmentation, targets_segmentation,
                               causal=True)
    cross_mask = attention_mask(targets, inputs, targets_segmentation, inputs_segmentation)
    y = self._embed(decoder_inputs, targets_positions, source=False, train=train)
    for layer in self.decoder_layers:
      y = layer(y, encoded, self_mask, cross_mask, train)
    return self._logits(y)

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
                        max_decode_len: int) -> dict[str, Any]:
    """The decoding cache for `beam_size` hypotheses per source sentence.

    Cross-attention keys/values are projected here, once per sentence, and shared by its beams.

    Args:
      encoded: [batch, src_len, d_model] from `encode`.
      inputs: [batch, src_len] source ids (0 = padding).
      beam_size: hypotheses per sentence (1 for greedy search or sampling).
      max_decode_len: number of decoding steps the cache holds.
    Returns:
      {'encoder_mask': [batch, src_len] bool, 'layers': one dict per decoder layer}.
    """
    self._check_length(max_decode_len, 'Decoding')
    c = self.config
    batch = encoded.shape[0]
    layers = []
    for layer in self.decoder_layers:
      cross_keys, cross_values = layer.cross_keys_values(encoded)
      # [batch, heads, head_dim, len * beam]: see `MultiHeadAttention.attend_transposed`.
      empty = jnp.zeros((batch, c.num_heads, c.head_dim, max_decode_len * beam_size), c.dtype)
      layers.append(dict(self_keys=empty, self_values=empty, cross_keys=cross_keys,
                         cross_values=cross_values))
    return {'encoder_mask': inputs > 0, 'layers': layers}

  def decode_step(self, tokens: Array, step: Array, cache: dict[str, Any],
                  cache_slots: Array | None = None) -> tuple[Array, dict[str, Any]]:
    """Logits for the next token of every hypothesis, given this step's tokens.

    Args:
      tokens: [batch, beam] int, the tokens at position `step` (0 = start symbol at step 0).
      step: scalar int32, the position being decoded.
      cache: from `init_decode_cache` or the previous step.
      cache_slots: [batch, beam, max_decode_len] int, for each hypothesis and each earlier
        step, the beam slot whose cache entry holds its ancestor's token at that step (beam
        search reorders this small index instead of the cache). None: slot b is hypothesis b.
    Returns:
      logits [batch, beam, vocab] float32 and the updated cache.
    """
    batch, beam = tokens.shape
    max_decode_len = cache['layers'][0]['self_keys'].shape[-1] // beam
    if cache_slots is None:
      cache_slots = jnp.broadcast_to(jnp.arange(beam)[None, :, None], (batch, beam, max_decode_len))
    # [batch, beam (query), len, beam (slot)], the cache's order: hypothesis q sees slot s at
    # step t iff its ancestor at t lives in slot s; the current step's entry is its own slot.
    time = jnp.arange(max_decode_len)
    cache_slots = jnp.where(time == step, jnp.arange(beam)[None, :, None], cache_slots)
    visible = ((cache_slots[..., None] == jnp.arange(beam)) & (time <= step)[:, None])
    self_mask = visible.reshape(batch, 1, beam, max_decode_len * beam)
    cross_mask = cache['encoder_mask'][:, None, None, :]
    positions = jnp.full((batch, beam), step, jnp.int32)
    y = self._embed(tokens, positions, source=False, train=False)
    new_layers = []
    for layer, layer_cache in zip(self.decoder_layers, cache['layers']):
      y, layer_cache = layer.step(y, step, layer_cache, self_mask, cross_mask)
      new_layers.append(layer_cache)
    return self._logits(y), {'encoder_mask': cache['encoder_mask'], 'layers': new_layers}


def count_params(params) -> int:
  """Number of scalars in a parameter tree."""
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
