"""The Transformer of "Attention Is All You Need" as pure functional Flax Linen modules."""

from model.decoding import (
    beam_search,
    greedy_search,
    length_penalty,
    sample,
    transformer_beam_search,
    transformer_ensemble_beam_search,
    transformer_greedy_search,
    transformer_sample,
)
from model.transformer import (
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    MultiHeadAttention,
    Transformer,
    TransformerConfig,
    count_params,
    shift_right,
    sinusoidal_table,
    upgrade_params,
)

__all__ = [
    'EOS_ID', 'PAD_ID', 'UNK_ID', 'Decoder', 'DecoderLayer', 'Encoder', 'EncoderLayer',
    'FeedForward', 'MultiHeadAttention', 'Transformer', 'TransformerConfig', 'beam_search',
    'count_params', 'greedy_search', 'length_penalty', 'sample', 'shift_right',
    'sinusoidal_table', 'transformer_beam_search', 'transformer_ensemble_beam_search',
    'transformer_greedy_search', 'transformer_sample', 'upgrade_params',
]
