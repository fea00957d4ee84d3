"""The Transformer of "Attention Is All You Need" as pure functional Flax Linen modules, its
searches, and the attentional RNN it replaced (`model/rnn.py`) with the same interface."""

from collections.abc import Mapping
from typing import Any

from model.config import TransformerConfig
from model.cpu.continuous_batching import transformer_continuous_beam_search
from model.ensemble import transformer_ensemble_beam_search
from model.masks import shift_right
from model.rnn import RNN, RNNConfig
from model.search import beam_search, greedy_search, length_penalty, sample
from model.tokens import EOS_ID, PAD_ID, UNK_ID
from model.transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    MultiHeadAttention,
    Transformer,
    count_params,
    sinusoidal_table,
)
from model.transformer_search import (
    transformer_beam_search,
    transformer_greedy_search,
    transformer_sample,
)

ARCHITECTURES = ('transformer', 'rnn')


def make_model(fields: Mapping[str, Any]) -> Transformer | RNN:
  """The model a config's `model` group describes: its `architecture` ('transformer', the
  default, or 'rnn') and the fields of TransformerConfig or RNNConfig."""
  fields = dict(fields)
  architecture = fields.pop('architecture', 'transformer')
  if architecture == 'transformer':
    return Transformer(TransformerConfig(**fields))
  if architecture == 'rnn':
    return RNN(RNNConfig(**fields))
  raise ValueError(f'architecture must be one of {list(ARCHITECTURES)}, got {architecture!r}.')


__all__ = [
    'ARCHITECTURES', 'EOS_ID', 'PAD_ID', 'RNN', 'UNK_ID', 'Decoder', 'DecoderLayer', 'Encoder',
    'EncoderLayer', 'FeedForward', 'MultiHeadAttention', 'RNNConfig', 'Transformer',
    'TransformerConfig', 'beam_search', 'count_params', 'greedy_search', 'length_penalty',
    'make_model', 'sample', 'shift_right', 'sinusoidal_table', 'transformer_beam_search',
    'transformer_continuous_beam_search', 'transformer_ensemble_beam_search',
    'transformer_greedy_search', 'transformer_sample',
]
