"""Forced decoding: a model reads given translations teacher-forced, as in training, and tells
what it thinks of each target token and where each looked in the source.

`attention_maps` records every attention's weights in one teacher-forced pass;
`forced_decoding` turns that pass into per-token log-probabilities and cross-attention (the
pictures of `plot_attention.py`, the alignments of `decode.py --output_format json`,
`decode.py --score_reference`, and the exported forced-decoding program of `serving.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.rnn import RNN
from model.tokens import PAD_ID
from model.transformer import Transformer

Array = jax.Array
# Each attention of the Transformer: (name, the module holding its layers, the attention).
ATTENTIONS = (('encoder_self_attention', 'encoder', 'self_attention'),
              ('decoder_self_attention', 'decoder', 'self_attention'),
              ('cross_attention', 'decoder', 'cross_attention'))


def attention_maps(model: Transformer | RNN, params: Any, inputs: Array,
                   targets: Array) -> tuple[Array, dict[str, list[Array]]]:
  """One teacher-forced pass that records every attention's weights.

  Args:
    inputs: [batch, src_len] source ids ending in EOS, 0-padded.
    targets: [batch, tgt_len] target ids ending in EOS, 0-padded.
  Returns:
    logits [batch, tgt_len, vocab] float32, and per attention ('encoder_self_attention',
    'decoder_self_attention', 'cross_attention') its weights per layer, float32 [batch, heads,
    queries, keys]. The RNN has one attention, 'cross_attention': one layer, one head.
  """
  logits, state = model.apply({'params': params}, inputs, targets, mutable=['intermediates'])
  recorded = state['intermediates']
  if isinstance(model, RNN):  # [batch, tgt_len, 1, src_len]: one head per step.
    steps = recorded['decoder']['attention_weights'][0]
    return logits, {'cross_attention': [steps.transpose(0, 2, 1, 3).astype(jnp.float32)]}
  maps = {}
  for name, side, attention in ATTENTIONS:
    layers = recorded[side]
    maps[name] = [layers[f'layers_{i}'][attention]['attention_weights'][0].astype(jnp.float32)
                  for i in range(len(layers)) if f'layers_{i}' in layers]
  return logits, maps


def forced_decoding(model: Transformer | RNN, params: Any, inputs: Array,
                    targets: Array) -> tuple[Array, Array]:
  """Per-token log-probabilities and cross-attention of given translations.

  Args:
    inputs: [batch, src_len] source ids ending in EOS, 0-padded.
    targets: [batch, tgt_len] target ids ending in EOS, 0-padded.
  Returns:
    token_log_probs [batch, tgt_len] float32: log p(targets[t] | source, targets[:t]) under
      the output layer's softmax (-inf for a piece it does not score), 0 at padding (a row
      sums to the translation's log-probability, as beam search scores it before the length
      penalty);
    cross_attention [batch, layers, tgt_len, src_len] float32: each decoder layer's
      cross-attention averaged over its heads (each target row sums to 1 over the source;
      rows of target padding are 0).
  """
  logits, maps = attention_maps(model, params, inputs, targets)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  real = targets != PAD_ID
  token_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  # A piece the output layer does not score (TransformerConfig.output_vocab_size) is one the
  # model cannot produce.
  token_log_probs = jnp.where(targets < log_probs.shape[-1], token_log_probs, -jnp.inf)
  cross = jnp.stack([weights.mean(axis=1) for weights in maps['cross_attention']], axis=1)
  return (jnp.where(real, token_log_probs, 0.0),
          jnp.where(real[:, None, :, None], cross, 0.0))


def alignment(cross_attention: Array) -> Array:
  """For each target token, the source position it attends to most: the argmax of the
  cross-attention averaged over layers. cross_attention [..., layers, tgt_len, src_len] ->
  [..., tgt_len] int32."""
  return jnp.argmax(cross_attention.mean(axis=-3), axis=-1).astype(jnp.int32)
