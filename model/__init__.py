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


def transformer_beam_search(model, params, inputs, *, beam_size=4, alpha=0.6, max_length=None,
                            max_extra_length=50, nbest=1, force_full_length=False):
  """`beam_search` for a Transformer."""
  return beam_search(model, params, inputs, beam_size=beam_size, alpha=alpha,
                     max_decode_len=max_length, max_extra_length=max_extra_length, nbest=nbest,
                     force_full_length=force_full_length)


__all__ = ['transformer_beam_search',
    'EOS_ID', 'PAD_ID', 'UNK_ID', 'Transformer', 'TransformerConfig', 'count_params',
    'shift_right', 'sinusoidal_table', 'beam_search', 'greedy_search', 'length_penalty', 'sample',
]
