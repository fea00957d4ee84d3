"""Input pipeline: what a training run reads, from one call (`make_data`).

Sources are prepared once by TFDS and read by index (nmt/data_sources.py); `read_split` gives
a split's texts for evaluation and decoding. The tokenizer, a joint sentencepiece BPE, is
trained once per run on a seeded sample of the training pairs. Training batches come from Grain
pipelines over fixed shards (nmt/train_pipeline.py). Process 0 alone trains the tokenizer and
prepares the data; the other processes wait for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from absl import logging

from model.tokens import EOS_ID
from nmt import batching, legacy
from nmt import tokenizer as tokenizer_lib
from nmt.data_sources import MULTI30K_ENV, PairSource, open_split, wait_for  # noqa: F401
from nmt.text_io import DataError, MissingDataError  # noqa: F401
from nmt.tokenizer import Tokenizer, load_tokenizer
from nmt.train_pipeline import FEATURE_KEYS, Settings, TrainIterator  # noqa: F401


def _texts(source: PairSource, indices: np.ndarray, name: str) -> list[tuple[str, str]]:
  """The whitespace-stripped (source, target) texts of the pairs at `indices`."""
  pairs = []
  for index, pair in zip(indices.tolist(), source.read(indices)):
    try:
      pairs.append(tuple(side.decode('utf-8').strip() for side in pair))
    except UnicodeDecodeError as e:
      raise DataError(f'{name}: pair {index} is not valid UTF-8 ({e}).') from None
  return pairs


def read_split(config, split: str, *, process_index: int = 0) -> tuple[list[str], list[str]]:
  """All (source, target) texts of a split, in dataset order, whitespace-stripped, for
  evaluation and decoding. Pairs with an empty side are dropped (and counted) for
  `config.data.train_split` only; evaluation splits keep them so that outputs stay aligned with
  reference files. Process 0 prepares the data, the others wait."""
  name = f'{config.data.dataset_name}/{split}'
  source = open_split(config, split, process_index=process_index)
  pairs = _texts(source, np.arange(len(source)), name)
  empty = sum(not (s and t) for s, t in pairs)
  if empty and split == config.data.train_split:
    pairs = [(s, t) for s, t in pairs if s and t]
    logging.warning('%s: skipped %d pairs with an empty side.', name, empty)
  elif empty:
    logging.warning('%s: %d pairs have an empty side (kept).', name, empty)
  logging.info('%s: %d pairs.', name, len(pairs))
  return [s for s, _ in pairs], [t for _, t in pairs]


def tokenizer_sample(config) -> list[str]:
  """The texts the tokenizer trains on: both sides of config.data.spm_sample_size // 2 pairs of
  the train split drawn without replacement (seed config.seed; every pair when the split is that
  small), all sources then all targets, each in corpus order; pairs with an empty side left out."""
  data = config.data
  source = open_split(config, data.train_split)
  indices = np.arange(len(source))
  if 2 * len(source) > data.spm_sample_size:
    rng = np.random.default_rng(config.seed)
    indices = np.sort(rng.choice(len(source), data.spm_sample_size // 2, replace=False))
  pairs = [p for p in _texts(source, indices, f'{data.dataset_name}/{data.train_split}') if all(p)]
  return [s for s, _ in pairs] + [t for _, t in pairs]


def load_or_train_tokenizer(config, workdir: str, *, process_index: int = 0) -> Tokenizer:
  """Loads workdir/tokenizer.model, or trains it on `tokenizer_sample(config)`: a vocabulary of
  config.model.vocab_size, the same bytes from the same data and seed; with
  `data.target_pieces_first`, renumbered so that the pieces of the training targets come first
  (`output_vocab_size`). Only process 0 trains (and prepares the data for it); the others wait
  for the file (workdir is shared by all)."""
  path = os.path.join(workdir, 'tokenizer.model')
  vocab_size = config.model.vocab_size
  if os.path.isfile(path):
    logging.info('Using existing tokenizer %s.', path)
  elif process_index != 0:
    wait_for(path, lambda: os.path.isfile(path), process_index)
  else:
    texts = tokenizer_sample(config)
    os.makedirs(workdir, exist_ok=True)
    model = tokenizer_lib.train(texts, vocab_size)
    if config.data.target_pieces_first:  # Of every training target, sampled or not.
      _, targets = read_split(config, config.data.train_split)
      ids = Tokenizer(tokenizer_lib.processor(model)).encode(targets)
      model = tokenizer_lib.put_first(model, np.unique(np.concatenate(ids)).tolist())
    tmp = f'{path}.tmp{os.getpid()}'
    Path(tmp).write_bytes(model)
    os.replace(tmp, path)  # Atomic: a waiting process never sees half a file.
    logging.info('Trained %d-piece BPE tokenizer on %d sentences: %s', vocab_size, len(texts), path)
  tokenizer = load_tokenizer(path)
  if tokenizer.vocab_size != vocab_size:
    raise DataError(f'{path} has {tokenizer.vocab_size} pieces but config.model.vocab_size is '
                    f'{vocab_size}: use a new workdir, or set the vocabulary size to match.')
  return tokenizer


# The output layer's size is rounded up to a multiple of this: matrix products and the CPU
# beam search's vocabulary blocks (model/cpu/decoding.py) take such widths without padding.
OUTPUT_VOCAB_MULTIPLE = 128


def output_vocab_size(config, tokenizer: Tokenizer, *, process_index: int = 0) -> int:
  """How many ids the model's output layer must score so that it covers every piece of every
  training target: the largest such id + 1, rounded up to OUTPUT_VOCAB_MULTIPLE (at most the
  vocabulary). With `data.target_pieces_first` the tokenizer numbers those pieces first."""
  _, targets = read_split(config, config.data.train_split, process_index=process_index)
  largest = max((int(ids.max()) for ids in tokenizer.encode(targets)), default=EOS_ID)
  size = min(-(-(largest + 1) // OUTPUT_VOCAB_MULTIPLE) * OUTPUT_VOCAB_MULTIPLE,
             tokenizer.vocab_size)
  logging.info('Output layer: ids 0-%d of %d, every piece of the %d training targets.',
               size - 1, tokenizer.vocab_size, len(targets))
  return size


class Data(NamedTuple):
  """What `make_data` returns: `train` gives this process's rows of each step, the six
  FEATURE_KEYS, int32 [batch_size / process_count, max_length]; `eval_batches` hold every
  evaluation pair once, {'inputs', 'targets'} int32 [rows, length] padded with PAD_ID."""
  tokenizer: Tokenizer
  train: TrainIterator
  eval_batches: list[dict[str, np.ndarray]]
  eval_sources: list[str]
  eval_targets: list[str]


def make_data(config, workdir: str, *, data_state: dict | None = None, row_multiple: int = 1,
              process_index: int = 0, process_count: int = 1) -> Data:
  """The tokenizer, the training iterator (from `data_state`, a checkpoint's, if given) and
  the evaluation batches (rows a multiple of `row_multiple`, e.g. the devices) of a run."""
  data = config.data
  tokenizer = load_or_train_tokenizer(config, workdir, process_index=process_index)
  source = open_split(config, data.train_split, process_index=process_index)
  settings = Settings.of(config, os.path.join(workdir, 'tokenizer.model'))
  train = TrainIterator(source, settings, process_index, process_count)
  state = legacy.upgrade_data_state(data_state, data.num_shards)
  if state is not None:
    train.set_state(state)
  logging.info('Train shards %d-%d of %d: %d of %d pairs, %d rows per step%s.',
               train.shards[0], train.shards[-1], data.num_shards,
               len(source) * len(train.shards) // data.num_shards, len(source),
               data.batch_size // process_count, ', resumed' if state else '')
  sources, targets = read_split(config, data.eval_split, process_index=process_index)
  eval_batches = [arrays for _, arrays in batching.length_batches(
      {'inputs': tokenizer.encode(sources), 'targets': tokenizer.encode(targets)},
      config.decode.batch_tokens, config.model.max_len, row_multiple=row_multiple,
      length_multiple=16)]
  return Data(tokenizer, train, eval_batches, sources, targets)
