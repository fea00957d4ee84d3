"""The attentional RNN encoder-decoder the Transformer replaced (Bahdanau et al., 2014; Luong
et al., 2015), with the Transformer's interface so that the same training, beam search,
checkpoints and averaging serve it.

Encoder: a stack of bidirectional LSTMs over the embedded source (each direction hidden_dim / 2
wide, so the encoder states are hidden_dim wide). Decoder, per target step t:

  x_t   = [embedding(y_{t-1}); a_{t-1}]          (input feeding: the previous attentional vector)
  h_t   = LSTM stack(x_t)
  c_t   = sum_s softmax_s(score(h_t, e_s)) e_s    (attention over the encoder states e_s)
  a_t   = tanh(W_c [c_t; h_t])                    (the attentional vector)
  p(y_t) = softmax(W_o a_t)

with score 'additive' v^T tanh(W_q h + W_k e) (Bahdanau), 'dot' h^T e or 'general' h^T W e
(Luong). The decoder starts from zero states. Packed rows: every LSTM restarts at each segment
start (the backward encoder direction at each segment end) and attention stays in the segment.

The teacher-forced pass and incremental decoding run the same decoder cell (a scan over the
target steps, or one step of it): the cache holds each hypothesis's LSTM states and
attentional vector, of constant size, and the encoder states shared by a sentence's beams.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Cache = dict[str, Any]
ATTENTION_SCORES = ('additive', 'dot', 'general')


@dataclasses.dataclass(frozen=True)
class RNNConfig:
  """Every choice of the RNN model; `architecture='rnn'` in a config's model group."""

  vocab_size: int
  embed_dim: int = 256
  hidden_dim: int = 512  # Decoder LSTMs; each encoder direction is hidden_dim / 2.
  num_encoder_layers: int = 2
  num_decoder_layers: int = 2
  dropout_rate: float = 0.3
  attention_score: str = 'additive'  # One of ATTENTION_SCORES.
  input_feeding: bool = True
  max_len: int = 256  # Longest sequence decoding and batching plan for.
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ('dtype', 'param_dtype'):
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
    if self.attention_score not in ATTENTION_SCORES:
      raise ValueError(f'attention_score must be one of {list(ATTENTION_SCORES)}, '
                       f'got {self.attention_score!r}.')
    if self.hidden_dim % 2:
      raise ValueError(f'hidden_dim must be even (two encoder directions), got {self.hidden_dim}.')
    for name in ('num_encoder_layers', 'num_decoder_layers', 'embed_dim', 'hidden_dim'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be positive, got {getattr(self, name)}.')

  @property
  def use_cpu_tuned(self) -> bool:
    """Beam search's CPU block top-k over logits (the only CPU-tuned piece the RNN uses)."""
    return jax.default_backend() == 'cpu'

  @property
  def use_cpu_decoding(self) -> bool:
    return False  # model/cpu/decoding.py's cache is the Transformer's.


def _segments(tokens: Array, segmentation: Array | None) -> Array:
  """[batch, length] int32: 0 at padding, else the token's segment (1 in unpacked rows)."""
  if segmentation is None:
    return (tokens > 0).astype(jnp.int32)
  return jnp.where(tokens > 0, segmentation, 0).astype(jnp.int32)


def _starts(segments: Array) -> Array:
  """[batch, length] bool: where a new segment (or padding run) begins."""
  previous = jnp.pad(segments, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
  return segments != previous


class RestartingLSTM(nn.Module):
  """One LSTM step that restarts from zero states where `restart` is set."""

  features: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, carry: tuple[Array, Array], inputs: tuple[Array, Array]):
    x, restart = inputs  # [batch, features_in], [batch] bool.
    carry = jax.tree_util.tree_map(lambda c: jnp.where(restart[:, None], 0, c), carry)
    return nn.OptimizedLSTMCell(self.features, dtype=self.dtype, param_dtype=self.param_dtype,
                                name='cell')(carry, x)


class LSTMLayer(nn.Module):
  """An LSTM over [batch, length, features], restarting at `restart` [batch, length]."""

  features: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: Array, restart: Array) -> Array:
    scan = nn.scan(RestartingLSTM, variable_broadcast='params', split_rngs={'params': False},
                   in_axes=1, out_axes=1)
    zeros = jnp.zeros(x.shape[:1] + (self.features,), self.dtype)
    _, outputs = scan(self.features, self.dtype, self.param_dtype, name='scan')(
        (zeros, zeros), (x, restart))
    return outputs


class Encoder(nn.Module):
  """Bidirectional LSTM layers: [batch, length, embed_dim] -> [batch, length, hidden_dim]."""

  config: RNNConfig

  @nn.compact
  def __call__(self, x: Array, segments: Array, train: bool) -> Array:
    c = self.config
    reversed_segments = segments[:, ::-1]
    for layer in range(c.num_encoder_layers):
      lstm = functools.partial(LSTMLayer, c.hidden_dim // 2, c.dtype, c.param_dtype)
      forward = lstm(name=f'forward_{layer}')(x, _starts(segments))
      backward = lstm(name=f'backward_{layer}')(x[:, ::-1], _starts(reversed_segments))
      x = jnp.concatenate([forward, backward[:, ::-1]], axis=-1)
      x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
    return x


class DecoderCell(nn.Module):
  """One decoder step for queries [batch, n, ...] (n = 1 in the teacher-forced scan, or the
  beam in decoding) over one sentence's encoder states."""

  config: RNNConfig

  @nn.compact
  def __call__(self, carry: Cache, inputs: tuple[Array, Array, Array], memory: Array,
               memory_keys: Array) -> tuple[Cache, Array]:
    """
    Args:
      carry: 'hidden', 'cell' (per layer [batch, n, hidden_dim]) and 'feed' [batch, n,
        hidden_dim], the previous attentional vector.
      inputs: embedded previous tokens [batch, n, embed_dim], restart [batch, n] bool (a new
        segment: zero states), mask [batch, n, src_len] bool (the source positions to attend).
      memory: encoder states [batch, src_len, hidden_dim]; memory_keys: their projection for
        the score, [batch, src_len, hidden_dim].
    Returns:
      The new carry, and the attentional vector [batch, n, hidden_dim].
    """
    c = self.config
    embedded, restart, mask = inputs
    carry = jax.tree_util.tree_map(lambda x: jnp.where(restart[..., None], 0, x), carry)
    x = jnp.concatenate([embedded, carry['feed']], -1) if c.input_feeding else embedded
    hidden, cell = [], []
    for layer in range(c.num_decoder_layers):
      (new_cell, new_hidden), x = nn.OptimizedLSTMCell(
          c.hidden_dim, dtype=c.dtype, param_dtype=c.param_dtype, name=f'lstm_{layer}')(
              (carry['cell'][layer], carry['hidden'][layer]), x)
      hidden.append(new_hidden)
      cell.append(new_cell)
    scores = attention_scores(c, x, memory_keys, self)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # [batch, n, src_len]
    # apply(..., mutable=['intermediates']) records them, [batch, tgt_len, n, src_len].
    self.sow('intermediates', 'attention_weights', weights)
    context = jnp.einsum('bns,bsd->bnd', weights.astype(c.dtype), memory)
    attentional = jnp.tanh(nn.Dense(c.hidden_dim, use_bias=False, dtype=c.dtype,
                                    param_dtype=c.param_dtype, name='combine')(
                                        jnp.concatenate([context, x], -1)))
    return {'hidden': hidden, 'cell': cell, 'feed': attentional}, attentional


def attention_scores(config: RNNConfig, query: Array, memory_keys: Array,
                     module: nn.Module) -> Array:
  """Float32 scores [batch, n, src_len] of decoder states [batch, n, hidden_dim]."""
  if config.attention_score == 'additive':
    projected = nn.Dense(config.hidden_dim, use_bias=False, dtype=config.dtype,
                         param_dtype=config.param_dtype, parent=module, name='query')(query)
    hidden = jnp.tanh(projected[:, :, None, :] + memory_keys[:, None, :, :])
    return nn.Dense(1, use_bias=False, dtype=jnp.float32, param_dtype=config.param_dtype,
                    parent=module, name='score')(hidden)[..., 0]
  return jnp.einsum('bnd,bsd->bns', query, memory_keys, preferred_element_type=jnp.float32)


class RNN(nn.Module):
  """Attentional LSTM encoder-decoder with `Transformer`'s methods (see the module docstring)."""

  config: RNNConfig

  def setup(self):
    c = self.config
    self.embed = nn.Embed(c.vocab_size, c.embed_dim, dtype=c.dtype, param_dtype=c.param_dtype,
                          embedding_init=nn.initializers.normal(stddev=c.embed_dim**-0.5))
    self.encoder = Encoder(c)
    if c.attention_score != 'dot':
      self.memory_projection = nn.Dense(c.hidden_dim, use_bias=False, dtype=c.dtype,
                                        param_dtype=c.param_dtype)
    self.dropout = nn.Dropout(c.dropout_rate)
    self.output_projection = nn.Dense(c.vocab_size, dtype=c.dtype, param_dtype=c.param_dtype)
    # The decoder cell scanned over target steps (one step in incremental decoding). Dropout
    # acts on its inputs (embeddings) and outputs (attentional vectors), outside the scan.
    self.decoder = nn.scan(DecoderCell, variable_broadcast='params',
                           split_rngs={'params': False}, variable_axes={'intermediates': 1},
                           in_axes=(1, nn.broadcast, nn.broadcast), out_axes=1)(c)

  def _check_length(self, length: int, what: str):
    if length > self.config.max_len:
      raise ValueError(f'{what} length {length} exceeds RNNConfig.max_len='
                       f'{self.config.max_len}; raise max_len or truncate the input.')

  def encode(self, inputs: Array, inputs_segmentation: Array | None = None,
             inputs_positions: Array | None = None, train: bool = False) -> Array:
    """inputs [batch, src_len] int -> encoder states [batch, src_len, hidden_dim]."""
    del inputs_positions  # Recurrence knows the order.
    self._check_length(inputs.shape[1], 'Source')
    x = self.dropout(self.embed(inputs), deterministic=not train)
    return self.encoder(x, _segments(inputs, inputs_segmentation), train)

  def _memory_keys(self, memory: Array) -> Array:
    return memory if self.config.attention_score == 'dot' else self.memory_projection(memory)

  def _logits(self, attentional: Array, train: bool) -> Array:
    return self.output_projection(
        self.dropout(attentional, deterministic=not train)).astype(jnp.float32)

  def _initial_carry(self, shape: tuple[int, ...]) -> Cache:
    c = self.config
    zeros = jnp.zeros(shape + (c.hidden_dim,), c.dtype)
    return {'hidden': [zeros] * c.num_decoder_layers, 'cell': [zeros] * c.num_decoder_layers,
            'feed': zeros}

  def decode(self, encoded: Array, inputs: Array, targets: Array,
             inputs_segmentation: Array | None = None,
             targets_segmentation: Array | None = None,
             targets_positions: Array | None = None, train: bool = False) -> Array:
    """Teacher-forced decoder: logits [batch, tgt_len, vocab] (float32) predicting `targets`."""
    del targets_positions
    self._check_length(targets.shape[1], 'Target')
    target_segments = _segments(targets, targets_segmentation)
    source_segments = _segments(inputs, inputs_segmentation)
    previous = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    restart = _starts(target_segments)
    previous = jnp.where(restart, 0, previous)  # Each segment starts from the start symbol 0.
    embedded = self.dropout(self.embed(previous), deterministic=not train)
    # [batch, tgt_len, src_len]: a target position attends to its own segment's source.
    mask = ((target_segments[:, :, None] == source_segments[:, None, :])
            & (target_segments > 0)[:, :, None])
    step_inputs = (embedded[:, :, None], restart[:, :, None], mask[:, :, None])
    _, attentional = self.decoder(self._initial_carry(targets.shape[:1] + (1,)),
                                          step_inputs, encoded, self._memory_keys(encoded))
    return self._logits(attentional[:, :, 0], train)

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
    """The decoding cache for `beam_size` hypotheses per sentence; its size does not depend
    on `max_length`.

    Returns:
      {'encoder_mask' [batch, src_len] bool, 'memory', 'memory_keys' [batch, src_len,
      hidden_dim], 'self_feed' [batch, beam, hidden_dim], 'layers': per decoder layer
      'self_hidden', 'self_cell' [batch, beam, hidden_dim]}; entries named self_* follow
      their hypotheses in beam search.
    """
    self._check_length(max_length, 'Decoding')
    carry = self._initial_carry((inputs.shape[0], beam_size))
    return {'encoder_mask': inputs > 0, 'memory': encoded,
            'memory_keys': self._memory_keys(encoded), 'self_feed': carry['feed'],
            'layers': [{'self_hidden': h, 'self_cell': c}
                       for h, c in zip(carry['hidden'], carry['cell'], strict=True)]}

  def decode_step(self, tokens: Array, step: Array, cache: Cache) -> tuple[Array, Cache]:
    """Logits [batch, beam, vocab] for the next token of every hypothesis, and the cache."""
    del step
    carry = {'hidden': [layer['self_hidden'] for layer in cache['layers']],
             'cell': [layer['self_cell'] for layer in cache['layers']],
             'feed': cache['self_feed']}
    batch, beam = tokens.shape
    mask = jnp.broadcast_to(cache['encoder_mask'][:, None], (batch, beam) +
                            cache['encoder_mask'].shape[1:])
    step_inputs = (self.embed(tokens)[:, None], jnp.zeros((batch, 1, beam), bool), mask[:, None])
    carry, attentional = self.decoder(carry, step_inputs, cache['memory'],
                                              cache['memory_keys'])
    layers = [{'self_hidden': h, 'self_cell': c}
              for h, c in zip(carry['hidden'], carry['cell'], strict=True)]
    return (self._logits(attentional[:, 0], False),
            {**cache, 'self_feed': carry['feed'], 'layers': layers})
