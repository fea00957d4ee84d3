"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

One class per box of the paper's Figure 1, bottom-up: attention, feed-forward, the residual
sub-layer connection, encoder layer, decoder layer, encoder, decoder, and the `Transformer`
that embeds tokens (with one shared matrix) and projects the decoder's output to the
vocabulary. Beside it: its config (`model/config.py`), token ids (`model/tokens.py`), masks
(`model/masks.py`), decoding caches (`model/decode_cache.py`) and the primitives it takes from
`model/cpu/` on the CPU (`model/backend.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import decode_cache, linear_attention
from model.backend import dense_apply, dropout, layer_norm
from model.config import ACTIVATIONS, ATTENTION_PROBS, TransformerConfig
from model.masks import LinearMask, default_positions, make_mask, shift_right

Array = jax.Array
Cache = dict[str, Any]


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
    """Float32 logits [batch, heads, q_len, k_len] of a projected query [batch, q_len, heads,
    head_dim] and keys [batch, k_len, heads, head_dim]."""
    if self.config.attention_score == 'additive':
      return self.additive_scores(query.transpose(0, 2, 1, 3), keys.transpose(0, 2, 3, 1))
    return jnp.einsum('bqhd,bkhd->bhqk', self.score_query(query), keys,
                      preferred_element_type=jnp.float32)

  def attend(self, x: Array, keys: Array, values: Array, mask: Array | LinearMask,
             train: bool) -> Array:
    """Queries from x [batch, q_len, d_model] attend to projected keys/values: the output
    [batch, q_len, d_model].

    Args:
      keys, values: [batch, k_len, heads, head_dim].
      mask: bool, broadcastable to [batch, heads, q_len, k_len] (`LinearMask` with linear
        attention).
      train: enables attention dropout.
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


class ScaleNorm(nn.Module):
  """ScaleNorm (Nguyen & Salazar 2019): g * x / ||x|| over the last axis, in float32.

  One learned scalar g per norm ('scale', initialised to sqrt(features)), no bias; ||x||^2 is
  held above `epsilon`. x: [..., features] -> the same shape in `dtype`.
  """

  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    g = self.param('scale', nn.initializers.constant(x.shape[-1] ** 0.5), (), self.param_dtype)
    return (unit_length(x, self.epsilon) * g.astype(jnp.float32)).astype(self.dtype)


def unit_length(x: Array, epsilon: float) -> Array:
  """x / ||x|| over the last axis, float32; ||x||^2 is held above `epsilon`."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.maximum(jnp.sum(x32 * x32, axis=-1, keepdims=True), epsilon))


def normalization(config: TransformerConfig) -> nn.Module:
  """The norm of every sub-layer connection and pre-LN stack end: `config.norm`'s."""
  if config.norm == 'scale':
    return ScaleNorm(epsilon=config.layer_norm_epsilon, dtype=config.dtype,
                     param_dtype=config.param_dtype)
  return layer_norm(config)


class SublayerConnection(nn.Module):
  """LayerNorm(x + Dropout(sublayer(x))) (post-LN, the paper) or x + Dropout(sublayer(LN(x)));
  ScaleNorm in place of LayerNorm with `norm='scale'`."""

  config: TransformerConfig

  def setup(self):
    self.norm = normalization(self.config)
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

  def step(self, y: Array, step: Array, layer_cache: Cache, self_mask: Array | None,
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

    def self_attend(z):
      out, written = decode_cache.self_attention_step(self.self_attention, z, step, layer_cache,
                                                      self_mask)
      new_cache.update(written)
      return out

    y = self.self_attention_sublayer(y, self_attend, False)
    # The beam axis plays the query axis of cross-attention: one source, `beam` queries, so the
    # encoder keys/values are neither copied per hypothesis nor reordered.
    y = self.cross_attention_sublayer(y, lambda z: decode_cache.cross_attention_step(
        self.cross_attention, z, layer_cache, cross_mask), False)
    return self.feed_forward_sublayer(y, self.feed_forward, False), new_cache


def layer_drop(stack: nn.Module, output: Array, x: Array, train: bool) -> Array:
  """A layer's output, or in training its input x with probability config.layer_drop_rate."""
  if not train or not (rate := stack.config.layer_drop_rate):
    return output
  return jnp.where(jax.random.bernoulli(stack.make_rng('dropout'), rate), x, output)


class Encoder(nn.Module):
  """The stack of encoder layers (and, pre-LN, a final LayerNorm) over embedded sources."""

  config: TransformerConfig

  def setup(self):
    self.layers = [EncoderLayer(self.config) for _ in range(self.config.num_encoder_layers)]
    if self.config.pre_norm:  # Pre-LN leaves the residual stream unnormalised.
      self.norm = normalization(self.config)

  def __call__(self, x: Array, mask: Array, train: bool = False) -> Array:
    """x: [batch, src_len, d_model] embedded; mask: [batch, 1, src_len, src_len] -> encoded."""
    for layer in self.layers:
      x = layer_drop(self, layer(x, mask, train), x, train)
    return self.norm(x) if self.config.pre_norm else x


class Decoder(nn.Module):
  """The stack of decoder layers (and, pre-LN, a final LayerNorm) over embedded targets."""

  config: TransformerConfig

  def setup(self):
    self.layers = [DecoderLayer(self.config) for _ in range(self.config.num_decoder_layers)]
    if self.config.pre_norm:
      self.norm = normalization(self.config)

  def __call__(self, y: Array, encoded: Array, self_mask: Array, cross_mask: Array,
               train: bool = False) -> Array:
    """y: [batch, tgt_len, d_model] embedded decoder inputs -> [batch, tgt_len, d_model]."""
    for layer in self.layers:
      y = layer_drop(self, layer(y, encoded, self_mask, cross_mask, train), y, train)
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
          c.num_outputs, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
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
    table = self.embed if c.share_embeddings else (
        self.source_embed if source else self.target_embed)
    x = table(tokens)
    if c.fix_norm:  # Every embedding at unit length before the paper's sqrt(d_model).
      x = unit_length(x, c.layer_norm_epsilon).astype(c.dtype)
    x = x * jnp.sqrt(jnp.asarray(c.d_model, c.dtype))
    if c.positional == 'sinusoidal':
      x = x + jnp.asarray(sinusoidal_table(c.max_len, c.d_model), c.dtype)[positions]
    else:
      x = x + self.position_embed(positions)
    return self.embedding_dropout(x, deterministic=not train)

  def _logits(self, y: Array) -> Array:
    """[..., d_model] -> float32 logits [..., num_outputs] through the (shared) embedding
    matrix: its first `num_outputs` rows."""
    c = self.config
    if c.share_embeddings:
      embedding = self.embed.embedding[:c.num_outputs]
      if c.fix_norm:  # The output layer scores with the same unit-length rows.
        embedding = unit_length(embedding, c.layer_norm_epsilon)
      embedding = embedding.astype(c.dtype)
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
      inputs_positions = default_positions(inputs, inputs_segmentation)
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
      targets_positions = default_positions(targets, targets_segmentation)
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
    return decode_cache.init(self.config, self.decoder.cross_keys_values(encoded), inputs,
                             beam_size, max_length)

  def decode_step(self, tokens: Array, step: Array, cache: Cache) -> tuple[Array, Cache]:
    """Logits for the next token of every hypothesis, given this step's tokens.

    Args:
      tokens: [batch, beam] int, the tokens at position `step` (0 = start symbol at step 0).
      step: scalar int32, the position being decoded; with the CPU decoding cache also
        [batch] int32, a position per sentence (`model/cpu/continuous_batching.py`).
      cache: from `init_decode_cache` or the previous step.
    Returns:
      logits [batch, beam, vocab] float32 and the updated cache.
    """
    self_mask, cache = decode_cache.self_attention_mask(self.config, cache, step)
    cross_mask = cache['encoder_mask'][:, None, None, :]
    positions = jnp.broadcast_to(jnp.reshape(step, (-1, 1)), tokens.shape).astype(jnp.int32)
    y = self._embed(tokens, positions, source=False, train=False)
    y, layers = self.decoder.step(y, step, cache['layers'], self_mask, cross_mask)
    return self._logits(y), {**cache, 'layers': layers}


def count_params(params) -> int:
  """Number of scalars in a parameter tree."""
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
