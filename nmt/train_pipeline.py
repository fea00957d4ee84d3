"""Packed training batches: one Grain pipeline per fixed shard of the train split.

Shard s of S (`data.num_shards`) holds pairs s, s + S, ... of the split. Its pipeline shuffles
them anew each epoch, reads and tokenizes CHUNK at a time (`EncodeChunk`), packs them best-fit
into rows of max_length per side and gives batch_size / S rows a step. Process p of P runs
shards [p S / P, (p + 1) S / P); a step's global batch is every shard's rows in shard order, so
it depends neither on P nor on `data.num_workers`. Its state, Grain's per shard, resumes on any
P that divides S.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import grain
import numpy as np
from absl import flags, logging

from model.tokens import UNK_ID
from nmt.data_sources import PairSource
from nmt.text_io import DataError
from nmt.tokenizer import Tokenizer, load_tokenizer

FEATURE_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
                'inputs_positions', 'targets_positions')
CHUNK = 256  # Pairs per read and per sentencepiece call.
DROPS = {'empty': 'an empty side', 'long': 'longer than data.max_length tokens',
         'invalid': 'invalid UTF-8'}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the pipelines depend on: config.data's keys, config.seed, the tokenizer's file."""
  tokenizer_path: str
  seed: int
  num_shards: int
  batch_size: int
  max_length: int
  packing_bins: int
  num_workers: int
  bpe_dropout: float
  source_token_dropout: float = 0.0

  @classmethod
  def of(cls, config, tokenizer_path: str) -> Settings:
    # A field with a default may be missing from configs written before it.
    return cls(tokenizer_path, config.seed, *(
        config.data[f.name] if f.default is dataclasses.MISSING else
        config.data.get(f.name, f.default) for f in dataclasses.fields(cls)[2:]))


class EncodeChunk(grain.transforms.RandomMap):
  """Shuffled local indices of a shard -> the token ids of its pairs that survive (BPE-dropout
  and source token dropout from the chunk's own generator) and how many were dropped, per
  reason in DROPS."""

  def __init__(self, source: PairSource, shard: int, settings: Settings):
    self._source, self._shard, self._settings = source, shard, settings
    self._tokenizer: Tokenizer | None = None  # Loaded in the process that runs the map.

  def __getstate__(self) -> dict[str, Any]:
    return dict(self.__dict__, _tokenizer=None)

  def random_map(self, indices: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    settings = self._settings
    if self._tokenizer is None:
      self._tokenizer = load_tokenizer(settings.tokenizer_path)
    decoded = []
    for pair in self._source.read(indices * settings.num_shards + self._shard):
      with contextlib.suppress(UnicodeDecodeError):
        decoded.append([side.decode('utf-8').strip() for side in pair])
    texts = [pair for pair in decoded if all(pair)]
    ids = [self._tokenizer.encode([pair[side] for pair in texts], dropout=settings.bpe_dropout,
                                  rng=rng) for side in (0, 1)]
    fits = [(s, t) for s, t in zip(*ids) if max(len(s), len(t)) <= settings.max_length]
    if settings.source_token_dropout:
      fits = [(drop_tokens(s, settings.source_token_dropout, rng), t) for s, t in fits]
    return {'pairs': fits, 'read': len(indices), 'invalid': len(indices) - len(decoded),
            'empty': len(decoded) - len(texts), 'long': len(texts) - len(fits)}


def drop_tokens(ids: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
  """ids [length] (ending in EOS) with each other piece replaced by UNK_ID with probability
  `rate`: word dropout (Sennrich & Zhang 2019; Gal & Ghahramani 2016) at the piece level, the
  unknown token's embedding standing in for the dropped piece."""
  dropped = rng.random(len(ids)) < rate
  dropped[-1] = False  # The end of the sentence stays.
  return np.where(dropped, UNK_ID, ids).astype(ids.dtype)


class Unchunk(grain.experimental.FlatMapTransform):
  """A chunk -> its pairs {'inputs', 'targets'}; logs the dropped pairs when their count first
  passes 1, 10, 100, ... (counted since this process started the shard)."""

  def __init__(self, shard: int):
    self.max_fan_out, self._shard = CHUNK, shard
    self._counts = dict.fromkeys(['read', *DROPS], 0)
    self._log_at = dict.fromkeys(DROPS, 1)

  def flat_map(self, chunk: dict[str, Any]):
    for key in self._counts:
      self._counts[key] += chunk[key]
    for key, why in DROPS.items():
      if self._counts[key] >= self._log_at[key]:
        self._log_at[key] = 10 ** len(str(self._counts[key]))
        logging.log(logging.INFO if key == 'long' else logging.WARNING,
                    'Train shard %d: dropped %d of %d pairs read so far (%s).', self._shard,
                    self._counts[key], self._counts['read'], why)
    return [{'inputs': s, 'targets': t} for s, t in chunk['pairs']]


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Grain's packed names -> the model's ('inputs_segment_ids' -> 'inputs_segmentation')."""
  return {k: row[k.replace('segmentation', 'segment_ids')] for k in FEATURE_KEYS}


def shard_seed(seed: int, shard: int) -> int:
  """Shard seeds far apart: Grain reseeds each epoch with seed + epoch."""
  return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


def pair_dataset(source: PairSource, shard: int, settings: Settings) -> grain.IterDataset:
  """Shard `shard`'s endless tokenized pairs {'inputs', 'targets'}: int32 ids ending in EOS."""
  pairs = len(range(shard, len(source), settings.num_shards))
  if not pairs:
    raise DataError(f'Train shard {shard} of {settings.num_shards} has no pairs: use fewer '
                    'shards (config.data.num_shards) or a larger train split.')
  seed = shard_seed(settings.seed, shard)
  chunks = grain.MapDataset.range(pairs).shuffle(seed=seed).repeat(None).batch(
      CHUNK, batch_fn=np.asarray).random_map(EncodeChunk(source, shard, settings), seed=seed)
  chunks = chunks.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=1))
  return grain.experimental.FlatMapIterDataset(chunks, Unchunk(shard))


def shard_dataset(source: PairSource, shard: int, settings: Settings) -> grain.IterDataset:
  """Shard `shard`'s endless packed batches: the six fields, int32 [rows, max_length]."""
  packed = grain.experimental.BestFitPackIterDataset(
      pair_dataset(source, shard, settings),
      length_struct={'inputs': settings.max_length, 'targets': settings.max_length},
      num_packing_bins=settings.packing_bins, seed=shard_seed(settings.seed, shard),
      shuffle_bins=True)
  return packed.map(_rename).batch(settings.batch_size // settings.num_shards,
                                   drop_remainder=True)


def _concat(parts) -> dict[str, np.ndarray]:
  return {k: np.concatenate([p[k] for p in parts]) for k in FEATURE_KEYS}


def _zip_state(state: dict[str, Any]) -> dict[str, Any]:
  """The ZipIterDataset state inside a group iterator's state: mp_prefetch holds it in its one
  worker's 'iterators_in_use_states'; thread prefetch and map pass it through as it is."""
  return state['iterators_in_use_states'][0] if 'iterators_in_use_states' in state else state


class TrainIterator:
  """This process's rows of each global batch: its shards' batches in shard order. The shards
  run in max(1, num_workers) contiguous groups, each a ZipIterDataset of the shards' pipelines,
  in a Grain worker process or (num_workers 0) in a thread of this process."""

  def __init__(self, source: PairSource, settings: Settings, process_index: int = 0,
               process_count: int = 1):
    count, per = settings.num_shards, settings.num_shards // process_count
    if settings.batch_size % count or count % process_count or process_index >= process_count:
      raise DataError(f'data.num_shards={count} must divide data.batch_size='
                      f'{settings.batch_size} and be a multiple of the {process_count} processes.')
    self.settings, self.shards = settings, range(process_index * per, (process_index + 1) * per)
    groups = max(1, min(settings.num_workers, per))
    self._groups = [group.tolist() for group in np.array_split(self.shards, groups)]
    if settings.num_workers and not flags.FLAGS.is_parsed():  # Grain reads its absl flags; a
      flags.FLAGS.mark_as_parsed()  # library caller may never have parsed any (train.py has).
    self._iters = []
    for group in self._groups:
      ds = grain.experimental.ZipIterDataset(
          [shard_dataset(source, s, settings) for s in group]).map(_concat)
      if settings.num_workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1, per_worker_buffer_size=2))
      else:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)
      self._iters.append(iter(ds))
    self._close = weakref.finalize(self, _close, self._iters)

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """The six fields, int32 [batch_size / process_count, max_length]."""
    return _concat([next(it) for it in self._iters])

  def get_state(self) -> dict[str, Any]:
    """{'num_shards': S, 'shards': {'s': Grain's state of shard s}} for this process's shards:
    after the batches returned so far. JSON-able."""
    shards = {str(s): state for group, it in zip(self._groups, self._iters)
              for s, state in zip(group, _zip_state(it.get_state())['parents'], strict=True)}
    return {'num_shards': self.settings.num_shards, 'shards': shards}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from `state`: any state that holds this process's shards, e.g. the union of
    every process's `get_state()` of a run on another number of processes."""
    if state.get('num_shards') != self.settings.num_shards:
      raise DataError(f"Data state of {state.get('num_shards')} shards; data.num_shards is "
                      f'{self.settings.num_shards}.')
    missing = [s for s in self.shards if str(s) not in state['shards']]
    if missing:
      raise DataError(f'Data state has no position for shards {missing}: it is one process\'s '
                      'part; merge every process\'s get_state()["shards"].')
    for group, it in zip(self._groups, self._iters):
      full = it.get_state()
      _zip_state(full)['parents'] = [state['shards'][str(s)] for s in group]
      it.set_state(full)

  def close(self) -> None:
    """Stops the prefetch threads or worker processes (also at exit, if still running)."""
    self._close()


def _close(iterators: list) -> None:
  for it in iterators:
    it.close()
  iterators.clear()  # Deleted now, while Python is whole.
