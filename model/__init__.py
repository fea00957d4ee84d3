"""The Transformer of "Attention Is All You Need" as pure functional Flax Linen modules."""

from model.decoding import beam_search, greedy_search, length_penalty, sample
from model.transformer import (
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Transformer,
    TransformerConfig,
    count_params,
    shift_right,
    sinusoidal_table,
)

__all__ = [
    'EOS_ID', 'PAD_ID', 'UNK_ID', 'Transformer', 'TransformerConfig', 'count_params',
    'shift_right', 'sinusoidal_table', 'beam_search', 'greedy_search', 'length_penalty', 'sample',
]
