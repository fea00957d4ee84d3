"""Length-sorted batches of whole sentences, for evaluation and decoding: few distinct shapes
to compile, and each batch as full as a token budget allows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from absl import logging

from model.tokens import EOS_ID, PAD_ID


def truncate(seqs: Sequence[np.ndarray], max_length: int, name: str) -> list[np.ndarray]:
  """seqs with those longer than max_length cut to max_length (ending in EOS), with a
  warning naming them as `name`."""
  seqs = list(seqs)
  long = [i for i, x in enumerate(seqs) if len(x) > max_length]
  if long:
    logging.warning('%s: truncating %d sequence(s) longer than %d tokens (indices %s%s).',
                    name, len(long), max_length, long[:10], ' ...' if len(long) > 10 else '')
  for i in long:
    seqs[i] = np.append(np.asarray(seqs[i][:max_length - 1]), EOS_ID)
  return seqs


def length_batches(sides: dict[str, Sequence[np.ndarray]], max_batch_tokens: int,
                   max_length: int | None = None, row_multiple: int = 1,
                   length_multiple: int = 8) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
  """Batches of whole sequences (or aligned pairs) sorted by length, for evaluation and decoding.

  A batch's rows are a power of two (at least `row_multiple`, rounded up to a multiple of it)
  and its length L is the longest side of its members rounded up to `length_multiple`: few
  distinct shapes to compile. rows * L <= max_batch_tokens, padding rows included, unless the
  batch has the minimum number of rows. Sequences longer than max_length are cut to max_length
  (ending in EOS) with a warning; a sequence longer than the budget gets a batch of its own.

  Args:
    sides: aligned lists of int id sequences, e.g. {'inputs': sources, 'targets': targets}.
  Returns:
    Per batch: indices [n] int64 into the lists (each index once over all batches), and each
    side's ids [rows, L] int32 padded with PAD_ID, rows >= n.
  """
  sides = {k: list(v) for k, v in sides.items()}
  if max_length is not None:
    sides = {name: truncate(seqs, max_length, name) for name, seqs in sides.items()}
  count = len(next(iter(sides.values())))
  longest = [max(len(seqs[i]) for seqs in sides.values()) for i in range(count)]
  padded = [max(1, -(-n // length_multiple) * length_multiple) for n in longest]
  # By padded length, then by length: a batch's members end at more similar output lengths,
  # and a batch runs as long as its longest output.
  order = np.lexsort((np.array(longest, np.int64), np.array(padded, np.int64)))
  def padded_rows(count: int) -> int:
    rows = max(row_multiple, 1 << (count - 1).bit_length())
    return -(-rows // row_multiple) * row_multiple

  groups: list[list[int]] = []
  for i in order.tolist():
    # Sorted ascending, so the newest member sets the padded length.
    if groups and padded_rows(len(groups[-1]) + 1) * padded[i] <= max_batch_tokens:
      groups[-1].append(i)
    else:
      groups.append([i])
  over = sorted(i for i in range(count) if padded[i] > max_batch_tokens)
  if over:
    logging.warning('%d sequence(s) exceed max_batch_tokens=%d (the longest %d tokens): each '
                    'gets a batch of its own (indices %s%s).', len(over), max_batch_tokens,
                    max(longest[i] for i in over), over[:10], ' ...' if len(over) > 10 else '')
  batches = []
  for group in groups:
    rows = padded_rows(len(group))
    arrays = {}
    for name, seqs in sides.items():
      ids = np.full((rows, padded[group[-1]]), PAD_ID, np.int32)
      for r, i in enumerate(group):
        ids[r, :len(seqs[i])] = seqs[i]
      arrays[name] = ids
    batches.append((np.array(group, np.int64), arrays))
  return batches
