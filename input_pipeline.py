"""Input pipeline: TFDS sources, joint sentencepiece BPE, packed training batches in streams.

Sources (`config.data.dataset_name`), all prepared and split by TFDS:
  * any TFDS translation dataset, e.g. 'wmt14_translate/de-en';
  * 'multi30k': the project's own builder below (Multi30k task 1, en/de/fr);
  * 'folder:/path': aligned plain-text files `{split}.{lang}` (e.g. train.en, train.de).

tf.data reads the training text; evaluation and decoding splits are parsed from TFDS's
TFRecord files here, without TensorFlow (importing it takes longer than translating a test
set); numpy does the rest. Training data flows in `config.data.num_streams`
streams: stream s is its even split of the train split (`tfds.even_splits`), whose records a
host reads from TFDS's files in chunks of 8,192 (one parse and one sentencepiece call per side
each) and keeps flat (one token array per side plus offsets, uint16 when the vocabulary fits).
Per epoch a stream permutes its pairs with a generator seeded by (seed, stream, epoch), packs
them best-fit in windows and shuffles the rows; the epoch is kept as pair order + row offsets,
and each step's arrays are built from them on demand. A step's global batch is every stream's
rows in stream order, and process p of P runs streams [p * S / P, (p + 1) * S / P): the global
batches do not depend on the number of processes, each process returns its contiguous slice of
them, and the state is one (epoch, batch_in_epoch) per stream.

Process 0 alone trains the tokenizer and prepares TFDS data; the other processes wait for them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gzip
import hashlib
import os
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from nmt import tokenizer as tokenizer_lib
from nmt.text_io import DataError, MissingDataError, read_lines
from nmt.tokenizer import Tokenizer, load_tokenizer

MULTI30K_ENV = 'MULTI30K_DIR'
FEATURE_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
                'inputs_positions', 'targets_positions')
READ_CHUNK_PAIRS = 8192  # Pairs per TFDS batch, and per sentencepiece call.
# How processes other than 0 wait for what process 0 makes (a tokenizer, prepared data):
# downloading and preparing WMT14 alone can take hours; a process 0 that dies meanwhile ends
# the job through JAX's heartbeat first.
WAIT_POLL_SECONDS = 1.0
WAIT_LOG_SECONDS = 30.0
WAIT_TIMEOUT_SECONDS = 24 * 3600.0


# ----------------------------------------------------------------------------- raw text


def read_parallel_files(folder: str, split: str, langs: Sequence[str]) -> dict[str, list[str]]:
  """Reads `{folder}/{split}.{lang}` for each lang; checks presence and line alignment."""
  paths = {lang: os.path.join(folder, f'{split}.{lang}') for lang in langs}
  missing = [p for p in paths.values() if not os.path.isfile(p)]
  if missing:
    have = sorted({f.rsplit('.', 1)[0] for f in os.listdir(folder) if '.' in f}) \
        if os.path.isdir(folder) else []
    raise MissingDataError(
        f'Missing {", ".join(missing)}: split {split!r} needs one aligned file per language '
        f'({", ".join(os.path.basename(p) for p in paths.values())}) in {folder}. '
        f'Splits found there: {have or "none"}.')
  cols = {lang: read_lines(p) for lang, p in paths.items()}
  counts = {paths[lang]: len(c) for lang, c in cols.items()}
  if len(set(counts.values())) > 1:
    raise DataError(f'Line counts differ: {counts}. Files of a split must be aligned line '
                    'by line (line n of one translates line n of the other); fix the files.')
  return cols


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


# ----------------------------------------------------------------------------- TFDS builders


class ParallelTextFolder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Aligned `{split}.{lang}` text files in a folder; every split with all languages.

  The builder config name fingerprints the folder path and the files' sizes and
  modification times, so editing the files prepares a fresh copy in data_dir.
  """

  VERSION = tfds.core.Version('1.0.0')

  def __init__(self, *, folder: str, languages: Sequence[str], **kwargs: Any):
    self._folder = os.path.abspath(folder)
    self._langs = tuple(languages)
    if not os.path.isdir(self._folder):
      raise MissingDataError(f'{folder}: dataset folder not found (config.data.dataset_name '
                             "'folder:<dir>' must name a folder with train.en, train.de, ...).")
    h = hashlib.sha256(f'{self._folder}|{self._langs}'.encode())
    for split in self.splits():
      for lang in self._langs:
        st = os.stat(os.path.join(self._folder, f'{split}.{lang}'))
        h.update(f'{split}.{lang}:{st.st_size}:{st.st_mtime_ns}'.encode())
    name = '_'.join(self._langs) + '_' + h.hexdigest()[:16]
    super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

  def splits(self) -> list[str]:
    """File stems that exist for every language."""
    stems = [set(f[:-len(lang) - 1] for f in os.listdir(self._folder) if f.endswith('.' + lang))
             for lang in self._langs]
    return sorted(set.intersection(*stems))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=f'Aligned text files from {self._folder}.',
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in self._langs}),
        disable_shuffling=True)  # Keep file order: read_split returns lines in order.

  def _split_generators(self, dl_manager):
    del dl_manager
    if not self.splits():
      raise MissingDataError(f'{self._folder}: no split has files for all of {self._langs} '
                             '(expected e.g. train.en and train.de).')
    return {s: self._generate_examples(read_parallel_files(self._folder, s, self._langs))
            for s in self.splits()}

  def _generate_examples(self, cols: dict[str, list[str]]):
    return _examples(cols)


def _examples(cols: dict[str, list[str]]):
  """(line index, {lang: text}) for aligned columns."""
  n = len(next(iter(cols.values())))
  for i in range(n):
    yield i, {lang: col[i] for lang, col in cols.items()}


class Multi30k(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Multi30k task 1 (Flickr30k captions), multi-way aligned en/de/fr.

  Reads a local copy of the unzipped release files when `local_dir` is given (never
  touches the network then), else downloads the gzip'd originals and gunzips them.
  Pinned checksums are sha256 of the *unzipped* files (computed from the unzipped
  originals; the .gz checksums could not be computed offline), verified after gunzip.
  A local copy is prepared under a builder config named by a fingerprint of its folder and
  files (as ParallelTextFolder's), so editing or replacing the files prepares a fresh copy.
  """

  VERSION = tfds.core.Version('1.0.0')
  SPLITS = ('train', 'val', 'test_2016_flickr')
  LANGS = ('en', 'de', 'fr')
  URL = 'https://github.com/multi30k/dataset/raw/master/data/task1/raw/{}.gz'
  SHA256 = {
      'train.en': '460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6',
      'train.de': '2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72',
      'train.fr': '5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d',
      'val.en': '1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227',
      'val.de': '660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660',
      'val.fr': '5304e444d842e962b2dda4d816b70b22a1765b15401642b7ca37a67477e708dc',
      'test_2016_flickr.en': '399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182',
      'test_2016_flickr.de': '4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16',
      'test_2016_flickr.fr': 'cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6',
  }

  def __init__(self, *, local_dir: str | None = None, **kwargs: Any):
    self._local_dir = local_dir
    name = 'release'
    if local_dir:
      h = hashlib.sha256(os.path.abspath(local_dir).encode())
      for file in self.SHA256:
        path = os.path.join(local_dir, file)
        st = os.stat(path) if os.path.isfile(path) else None
        h.update(f'{file}:{st and st.st_size}:{st and st.st_mtime_ns}'.encode())
      name = 'local_' + h.hexdigest()[:16]
    super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description='Multi30k task 1: image captions in en, de, fr.',
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in self.LANGS}),
        homepage='https://github.com/multi30k/dataset', disable_shuffling=True)

  def _split_generators(self, dl_manager):
    if self._local_dir:
      folder = self._local_dir
      missing = [f for f in self.SHA256 if not os.path.isfile(os.path.join(folder, f))]
      if missing:
        raise MissingDataError(
            f'Multi30k local copy {folder} lacks {", ".join(missing)}. Put the unzipped task-1 '
            f'files {", ".join(self.SHA256)} there (from {self.URL.format("{split}.{lang}")}).')
      for name, digest in self.SHA256.items():
        if _sha256(os.path.join(folder, name)) != digest:
          # A local copy is the user's choice (maybe corrected); warn, do not refuse.
          logging.warning('%s differs from the Multi30k release file (sha256).', name)
    else:
      try:
        # Fail fast offline: TFDS would otherwise retry each URL for minutes.
        socket.create_connection(('github.com', 443), timeout=15).close()
        gz = dl_manager.download({name: self.URL.format(name) for name in self.SHA256})
      except Exception as e:  # Any network/SSL/HTTP failure: say what to do offline.
        raise DataError(
            f'Could not download Multi30k ({e}). Offline: put the unzipped files '
            f'{", ".join(self.SHA256)} in a folder and set ${MULTI30K_ENV} or '
            'config.data.manual_dir to it.') from e
      folder = os.path.join(dl_manager.download_dir, 'multi30k_task1_unzipped')
      os.makedirs(folder, exist_ok=True)
      for name, digest in self.SHA256.items():
        out = os.path.join(folder, name)
        with gzip.open(os.fspath(gz[name]), 'rb') as src, open(out, 'wb') as dst:
          shutil.copyfileobj(src, dst)
        if _sha256(out) != digest:
          raise DataError(f'{out}: sha256 mismatch after gunzip of {self.URL.format(name)}; '
                          'the download is corrupt or the release changed.')
    return {s: self._generate_examples(read_parallel_files(folder, s, self.LANGS))
            for s in self.SPLITS}

  def _generate_examples(self, cols: dict[str, list[str]]):
    return _examples(cols)


def _builder(config) -> tfds.core.DatasetBuilder:
  """The TFDS builder of config.data.dataset_name."""
  config = config.data
  data_dir = config.data_dir or None
  name = config.dataset_name
  langs = (config.source_lang, config.target_lang)
  if name.startswith('folder:'):
    return ParallelTextFolder(folder=name[len('folder:'):], languages=langs, data_dir=data_dir)
  if name == 'multi30k':
    local = config.manual_dir or os.environ.get(MULTI30K_ENV) or None
    return Multi30k(local_dir=local, data_dir=data_dir)
  try:
    return tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f'Unknown dataset {name!r} (config.data.dataset_name): not a TFDS name. Use a '
                    "TFDS translation dataset (e.g. 'wmt14_translate/de-en'), 'multi30k' or "
                    "'folder:/path/to/dir'.") from e


def wait_for(what: str, ready: Callable[[], bool], process_index: int) -> None:
  """Polls `ready()` until it holds; logs every WAIT_LOG_SECONDS, fails after the timeout."""
  start = last_log = time.monotonic()
  while not ready():
    now = time.monotonic()
    if now - start > WAIT_TIMEOUT_SECONDS:
      raise DataError(f'Process {process_index} waited {now - start:.0f} s for {what}, which '
                      'process 0 makes: check that process 0 runs and what its log says.')
    if now - last_log >= WAIT_LOG_SECONDS:
      logging.info('Process %d waits for %s (%.0f s so far).', process_index, what, now - start)
      last_log = now
    time.sleep(WAIT_POLL_SECONDS)


def prepared_builder(config, *, process_index: int = 0) -> tfds.core.DatasetBuilder:
  """The builder of config.data.dataset_name, prepared in its data_dir.

  Process 0 downloads and prepares (once; later runs read the prepared copy); the other
  processes wait until it is prepared, so they never write into the same data_dir at once.
  """
  builder = _builder(config)
  data = config.data
  langs = list(builder.info.features.keys())  # Known before (a long) prepare.
  for lang in (data.source_lang, data.target_lang):
    if lang not in langs:
      raise DataError(f'Language {lang!r} not in {data.dataset_name!r} (has {langs}); '
                      'check config.data.source_lang / config.data.target_lang.')
  if builder.is_prepared():
    return builder
  if process_index == 0:
    logging.info('Preparing %s in %s (once; later runs read it from there).',
                 data.dataset_name, builder.data_dir)
    builder.download_and_prepare()
    return builder
  wait_for(f'{data.dataset_name} to be prepared in {builder.data_dir}', builder.is_prepared,
           process_index)
  return _builder(config)  # Reads the prepared copy's info (split sizes).


def _check_split(builder: tfds.core.DatasetBuilder, config, split: str) -> None:
  if split not in builder.info.splits:
    raise MissingDataError(f'Split {split!r} not in {config.data.dataset_name!r}; available: '
                           f'{sorted(builder.info.splits)}.')


def _text_chunks(builder: tfds.core.DatasetBuilder, config,
                 split) -> Iterator[tuple[list[str], list[str]]]:
  """(sources, targets) of a split (or sub-split), whitespace-stripped, READ_CHUNK_PAIRS at a time.

  In dataset order: files are read in order (shuffle_files=False).
  """
  src_lang, tgt_lang = config.data.source_lang, config.data.target_lang
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(READ_CHUNK_PAIRS)
  for batch in tfds.as_numpy(ds):
    yield ([s.decode('utf-8').strip() for s in batch[src_lang]],
           [t.decode('utf-8').strip() for t in batch[tgt_lang]])


def _reads_files_directly(builder: tfds.core.DatasetBuilder, config) -> bool:
  """Whether TFDS's files of the two languages can be read without TFDS's reader: TFRecord
  files of tf.train.Example whose language features are plain Text (a scalar string each).
  Decided without importing TensorFlow."""
  if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
    return False
  if not any(epath.Path(builder.data_dir).glob('*.tfrecord*')):
    return False  # No files of its own (tfds.testing.mock_data): TFDS's reader supplies it.
  features = builder.info.features
  return all(lang in features.keys() and isinstance(features[lang], tfds.features.Text) and
             getattr(features[lang], 'encoder', None) is None
             for lang in (config.data.source_lang, config.data.target_lang))


def _instruction_chunks(config, instructions) -> Iterator[tuple[list[str], list[str]]]:
  """Texts of TFDS file instructions (file, skip, take), in order, READ_CHUNK_PAIRS at a time.

  Reads the records straight from TFDS's files and parses each chunk's examples in one call
  (TFDS's own reader parses them one at a time, which costs most of its time); adjacent ranges
  of a file are read as one, so each file is scanned once.
  """
  import tensorflow as tf  # Imported where training data is read: decoding needs none of it.
  spec = {lang: tf.io.FixedLenFeature([], tf.string)
          for lang in (config.data.source_lang, config.data.target_lang)}
  ranges = []  # [filename, skip, take]
  for fi in instructions:
    if ranges and ranges[-1][0] == fi.filename and sum(ranges[-1][1:]) == fi.skip:
      ranges[-1][2] += fi.take
    elif fi.take:
      ranges.append([fi.filename, fi.skip, fi.take])
  if not ranges:
    return
  ds = None
  for filename, skip, take in ranges:
    part = tf.data.TFRecordDataset(filename).skip(skip).take(take)
    ds = part if ds is None else ds.concatenate(part)
  ds = ds.batch(READ_CHUNK_PAIRS).map(lambda records: tf.io.parse_example(records, spec))
  src_lang, tgt_lang = config.data.source_lang, config.data.target_lang
  for batch in ds.prefetch(1).as_numpy_iterator():
    yield ([s.decode('utf-8').strip() for s in batch[src_lang]],
           [t.decode('utf-8').strip() for t in batch[tgt_lang]])


def _split_chunks(builder: tfds.core.DatasetBuilder, config,
                  split) -> Iterator[tuple[list[str], list[str]]]:
  """Like `_text_chunks` (same pairs and chunking), through `_instruction_chunks` if it can."""
  if not _reads_files_directly(builder, config):
    return _text_chunks(builder, config, split)
  return _instruction_chunks(config, builder.info.splits[split].file_instructions)


# CRC-32C (Castagnoli) by byte, for the checksums of TFRecord files.
_CRC32C = [functools.reduce(lambda c, _: (c >> 1) ^ (0x82F63B78 if c & 1 else 0), range(8), n)
           for n in range(256)]


def _masked_crc32c(data: bytes) -> int:
  """A TFRecord checksum: CRC-32C of data, rotated right by 15 bits plus a constant."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  crc ^= 0xFFFFFFFF
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tfrecords(path: str, skip: int, take: int) -> Iterator[bytes]:
  """Records skip .. skip + take - 1 of a TFRecord file, their checksums verified. A record is
  its length (uint64, little-endian), the length's checksum, its bytes and their checksum."""
  with epath.Path(path).open('rb') as f:
    for index in range(skip + take):
      header = f.read(12)
      length, crc = struct.unpack('<QI', header) if len(header) == 12 else (0, None)
      if crc != _masked_crc32c(header[:8]):
        raise DataError(f'{path}: record {index} is damaged or missing (the file holds fewer '
                        f'than the {skip + take} records its dataset lists).')
      if index < skip:
        f.seek(length + 4, os.SEEK_CUR)
        continue
      data, footer = f.read(length), f.read(4)
      if len(footer) < 4 or struct.unpack('<I', footer)[0] != _masked_crc32c(data):
        raise DataError(f'{path}: record {index} is damaged (its checksum differs).')
      yield data


def _protobuf_fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
  """(field number, start, end) of each length-delimited field of the protobuf message in
  data[start:end]; fields of other wire types are skipped."""
  def varint(pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
      byte = data[pos]
      value, pos, shift = value | (byte & 0x7F) << shift, pos + 1, shift + 7
      if byte < 0x80:
        return value, pos
  pos = start
  while pos < end:
    key, pos = varint(pos)
    wire = key & 7
    if wire == 2:
      size, pos = varint(pos)
      yield key >> 3, pos, pos + size
      pos += size
    elif wire == 0:
      pos = varint(pos)[1]
    elif wire in (1, 5):
      pos += 8 if wire == 1 else 4
    else:
      raise DataError(f'Not a tf.train.Example record (protobuf wire type {wire}).')


def _example_texts(record: bytes, names: tuple[str, ...]) -> list[str]:
  """The string features `names` of a serialized tf.train.Example, as TFDS writes Text
  (Example.features = 1; Features.feature = 1, a map entry of key = 1 and value = 2;
  Feature.bytes_list = 1; BytesList.value = 1)."""
  texts = {}
  for _, start, end in _protobuf_fields(record, 0, len(record)):
    for _, entry_start, entry_end in _protobuf_fields(record, start, end):
      key, value = None, None
      for field, s, e in _protobuf_fields(record, entry_start, entry_end):
        if field == 1:
          key = record[s:e].decode('utf-8')
        elif field == 2:
          value = (s, e)
      if key in names and value is not None:
        for field, s, e in _protobuf_fields(record, *value):
          if field == 1:  # bytes_list
            texts[key] = next((record[vs:ve].decode('utf-8') for f, vs, ve in
                               _protobuf_fields(record, s, e) if f == 1), '')
  missing = [name for name in names if name not in texts]
  if missing:
    raise DataError(f'A record has no text feature {missing[0]!r}.')
  return [texts[name] for name in names]


def _split_pairs(builder: tfds.core.DatasetBuilder, config, split) -> tuple[list[str], list[str]]:
  """A split's (sources, targets), whitespace-stripped, in dataset order (`_text_chunks`'s),
  read from TFDS's files without TensorFlow when it can (`_reads_files_directly`)."""
  if not _reads_files_directly(builder, config):
    src, tgt = [], []
    for s, t in _text_chunks(builder, config, split):
      src.extend(s)
      tgt.extend(t)
    return src, tgt
  names = (config.data.source_lang, config.data.target_lang)
  pairs = [_example_texts(record, names)
           for fi in builder.info.splits[split].file_instructions
           for record in _tfrecords(fi.filename, fi.skip, fi.take)]
  return [s.strip() for s, _ in pairs], [t.strip() for _, t in pairs]


def read_split(config, split: str, *, process_index: int = 0,
               process_count: int = 1) -> tuple[list[str], list[str]]:
  """All (source, target) texts of a split, in dataset order, whitespace-stripped.

  For evaluation and decoding (the train split goes through the streams instead). Pairs with
  an empty side are dropped (and counted) for `config.data.train_split` only; evaluation splits
  keep them so that outputs stay aligned with reference files. process_index/process_count:
  see `prepared_builder`.
  """
  data = config.data
  builder = _builder(config)
  if isinstance(builder, ParallelTextFolder) and split not in builder.splits():
    read_parallel_files(builder._folder, split, (data.source_lang, data.target_lang))  # Raises.
  builder = prepared_builder(config, process_index=process_index)
  _check_split(builder, config, split)
  src, tgt = _split_pairs(builder, config, split)
  empty = sum(1 for s, t in zip(src, tgt, strict=True) if not s or not t)
  if empty and split == data.train_split:
    keep = [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]
    src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    logging.warning('%s/%s: skipped %d pairs with an empty side.', data.dataset_name, split,
                    empty)
  elif empty:
    logging.warning('%s/%s: %d pairs have an empty side (kept).', data.dataset_name, split,
                    empty)
  logging.info('%s/%s: %d pairs.', data.dataset_name, split, len(src))
  return src, tgt


# ----------------------------------------------------------------------------- tokenizer


def tokenizer_sample(config) -> list[str]:
  """The texts the tokenizer trains on: a seeded sample of the train split's pairs.

  At most config.data.spm_sample_size sentences: both sides of spm_sample_size // 2 pairs
  drawn without replacement (seed config.seed; every pair when the split is that small),
  all sources then all targets, each in corpus order. Streams the split in chunks and keeps
  only the drawn pairs' text; pairs with an empty side are left out.
  """
  data = config.data
  builder = prepared_builder(config)
  _check_split(builder, config, data.train_split)
  num_pairs = builder.info.splits[data.train_split].num_examples
  drawn = None  # [num_pairs] bool, or None: every pair.
  if 2 * num_pairs > data.spm_sample_size:
    rng = np.random.default_rng(config.seed)
    drawn = np.zeros(num_pairs, bool)
    drawn[rng.choice(num_pairs, data.spm_sample_size // 2, replace=False)] = True
  sources, targets, start = [], [], 0
  for src, tgt in _split_chunks(builder, config, data.train_split):
    chunk = range(len(src)) if drawn is None else np.flatnonzero(drawn[start:start + len(src)])
    start += len(src)
    for i in chunk:
      if src[i] and tgt[i]:
        sources.append(src[i])
        targets.append(tgt[i])
  return sources + targets


def load_or_train_tokenizer(config, workdir: str, *, process_index: int = 0,
                            process_count: int = 1) -> Tokenizer:
  """Loads workdir/tokenizer.model, or trains it on `tokenizer_sample(config)`.

  Its vocabulary is config.model.vocab_size; the same data and seed give the same bytes
  (`nmt.tokenizer.train`). Only process 0 trains (and
  prepares the data for it); the others wait for the file (workdir is shared by all processes).
  """
  path = os.path.join(workdir, 'tokenizer.model')
  vocab_size = config.model.vocab_size
  if not os.path.isfile(path) and process_index != 0:
    wait_for(path, lambda: os.path.isfile(path), process_index)
  if os.path.isfile(path):
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != vocab_size:
      raise DataError(f'{path} has {tokenizer.vocab_size} pieces but config.model.vocab_size is '
                      f'{vocab_size}: use a new workdir, or set the vocabulary size to match.')
    logging.info('Using existing tokenizer %s.', path)
    return tokenizer
  texts = tokenizer_sample(config)
  os.makedirs(workdir, exist_ok=True)
  model = tokenizer_lib.train(texts, vocab_size)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(model)
  os.replace(tmp, path)  # Atomic: a waiting process never sees half a file.
  logging.info('Trained %d-piece BPE tokenizer on %d sentences: %s', vocab_size,
               len(texts), path)
  return load_tokenizer(path)


# ----------------------------------------------------------------------------- packing


def _positions(lengths: np.ndarray) -> np.ndarray:
  """[sum(lengths)] int64: 0, 1, ..., lengths[0] - 1, then 0, 1, ..., lengths[1] - 1, ... ."""
  lengths = np.asarray(lengths, np.int64)
  begins = np.cumsum(lengths) - lengths
  return np.arange(int(lengths.sum())) - np.repeat(begins, lengths)


def pack_rows(src_lens: np.ndarray, tgt_lens: np.ndarray, order: np.ndarray,
              max_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Best-fit-decreasing packing of pairs into rows of max_length tokens per side.

  Pairs go in decreasing source + target length (then decreasing source length, then their
  place in `order`), each into the open row it leaves the least room in (source + target; ties:
  least source room, then the row placed into last), or a new row if none fits. Pairs of equal
  lengths are placed in bulk: a row the rule picks for one of them takes as many as fit, so the
  cost is per run of rows of equal room, not per pair.

  Open rows are indexed by their remaining (source, target) room in a [max_length + 1]^2 grid.

  Args:
    src_lens, tgt_lens: [num_pairs] token counts (incl. EOS), each in [1, max_length].
    order: [n] pair indices to pack.
  Returns:
    pair_order [n] int64 (the pairs of `order`, row after row, each row's in segment order) and
    row_offsets [rows + 1] int64: row r holds pair_order[row_offsets[r]:row_offsets[r + 1]].
  """
  order = np.asarray(order, np.int64)
  a_of, b_of = np.asarray(src_lens)[order], np.asarray(tgt_lens)[order]
  by_size = np.lexsort((-a_of, -(a_of + b_of)))  # Stable: ties keep their place in `order`.
  pairs, a_of, b_of = order[by_size], a_of[by_size], b_of[by_size]
  room = np.arange(max_length + 1)
  slack = room[:, None] + room[None, :]  # Leftover room if a row with (rs, rt) is used.
  counts = np.zeros((max_length + 1, max_length + 1), np.int64)
  cells: dict[tuple[int, int], list[int]] = {}  # (rs, rt) -> open rows, last placed last.
  row_of = np.empty(len(pairs), np.int64)  # Row of each pair of `pairs`.
  num_rows, done, big = 0, 0, 4 * max_length + 1
  starts = np.flatnonzero(np.diff(a_of, prepend=-1) | np.diff(b_of, prepend=-1))
  for start, end in zip(starts.tolist(), starts[1:].tolist() + [len(pairs)], strict=True):
    a, b, left = int(a_of[start]), int(b_of[start]), end - start
    while left:
      cand = np.where(counts[a:, b:] > 0, slack[a:, b:], big)
      k = int(cand.argmin())
      if cand.flat[k] == big:  # No open row fits: new rows.
        rs = rt = max_length
        per_row = min(rs // a, rt // b)
        picked = list(range(num_rows, num_rows - (-left // per_row)))
        num_rows += len(picked)
      else:
        i, j = divmod(k, cand.shape[1])
        rs, rt = a + i, b + j
        per_row = min(rs // a, rt // b)
        rows = cells[(rs, rt)]
        used = min(len(rows), -(-left // per_row))
        picked = rows[len(rows) - used:][::-1]  # The row placed into last comes first.
        del rows[len(rows) - used:]
        counts[rs, rt] -= used
      # Each picked row takes per_row pairs, the last one what is left if that is fewer.
      last = min(per_row, left - per_row * (len(picked) - 1))
      n = per_row * (len(picked) - 1) + last
      row_of[done:done + n - last] = np.repeat(picked[:-1], per_row)
      row_of[done + n - last:done + n] = picked[-1]
      done, left = done + n, left - n
      for rows, copies in ((picked[:-1], per_row), (picked[-1:], last)):
        if rows:
          cell = (rs - copies * a, rt - copies * b)
          counts[cell] += len(rows)
          cells.setdefault(cell, []).extend(rows)
  by_row = np.argsort(row_of, kind='stable')
  row_offsets = np.zeros(num_rows + 1, np.int64)
  np.cumsum(np.bincount(row_of, minlength=num_rows), out=row_offsets[1:])
  return pairs[by_row], row_offsets


@dataclasses.dataclass(frozen=True)
class TokenizedPairs:
  """Pairs stored flat: pair i's source is source_tokens[source_offsets[i]:source_offsets[i + 1]].

  Fields: source_tokens [source tokens], target_tokens [target tokens] (uint16 or int32, each
  pair's ids ending with EOS_ID); source_offsets, target_offsets [num_pairs + 1] int64.
  """

  source_tokens: np.ndarray
  source_offsets: np.ndarray
  target_tokens: np.ndarray
  target_offsets: np.ndarray

  @property
  def num_pairs(self) -> int:
    return len(self.source_offsets) - 1

  @property
  def source_lengths(self) -> np.ndarray:
    return np.diff(self.source_offsets)

  @property
  def target_lengths(self) -> np.ndarray:
    return np.diff(self.target_offsets)

  def side(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) of 'inputs' (the source) or 'targets'."""
    if name == 'inputs':
      return self.source_tokens, self.source_offsets
    return self.target_tokens, self.target_offsets


def _stream_chunks(builder: tfds.core.DatasetBuilder, config, streams: Sequence[int],
                   num_streams: int) -> Iterator[tuple[int, list[str], list[str]]]:
  """(stream, sources, targets) pieces of the streams' even splits of the train split, in order.

  Each stream starts with an empty piece; streams that are adjacent in the split are read in
  one pass.
  """
  splits = tfds.even_splits(config.data.train_split, num_streams)
  if not _reads_files_directly(builder, config):
    for stream in streams:
      yield stream, [], []
      for src, tgt in _text_chunks(builder, config, splits[stream]):
        yield stream, src, tgt
    return
  infos = [builder.info.splits[splits[stream]] for stream in streams]
  chunks = _instruction_chunks(config, [fi for info in infos for fi in info.file_instructions])
  src, tgt = [], []
  for stream, info in zip(streams, infos, strict=True):
    yield stream, [], []
    left = info.num_examples
    while left:
      if not src:
        src, tgt = next(chunks)
      n = min(left, len(src))
      yield stream, src[:n], tgt[:n]
      src, tgt, left = src[n:], tgt[n:], left - n


class _PairCollector:
  """Tokenizes one stream's text pieces into flat arrays, dropping empty and long pairs."""

  def __init__(self, tokenizer: Tokenizer, max_length: int):
    self._tokenizer, self._max_length = tokenizer, max_length
    self._parts = {'inputs': ([], []), 'targets': ([], [])}  # Side -> token, length chunks.
    self.counts = {'read': 0, 'empty': 0, 'long': 0}

  def add(self, src: list[str], tgt: list[str]) -> None:
    self.counts['read'] += len(src)
    keep = [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]
    self.counts['empty'] += len(src) - len(keep)
    if not keep:
      return
    encoded = {side: self._tokenizer.encode_flat([texts[i] for i in keep])
               for side, texts in (('inputs', src), ('targets', tgt))}
    fits = ((encoded['inputs'][1] <= self._max_length) &
            (encoded['targets'][1] <= self._max_length))
    self.counts['long'] += int((~fits).sum())
    for side, (tokens, lengths) in encoded.items():
      self._parts[side][0].append(tokens[np.repeat(fits, lengths)])
      self._parts[side][1].append(lengths[fits])

  def pairs(self) -> TokenizedPairs:
    flat = []
    for token_chunks, length_chunks in self._parts.values():
      lengths = np.concatenate(length_chunks or [np.zeros(0, np.int64)])
      offsets = np.zeros(len(lengths) + 1, np.int64)
      np.cumsum(lengths, out=offsets[1:])
      flat += [np.concatenate(token_chunks or [np.zeros(0, self._tokenizer.token_dtype)]),
               offsets]
    return TokenizedPairs(*flat)


def read_streams(builder: tfds.core.DatasetBuilder, config, tokenizer: Tokenizer,
                 streams: Sequence[int],
                 num_streams: int) -> Iterator[tuple[int, TokenizedPairs, dict[str, int]]]:
  """Streams `streams` (ascending) of `num_streams`, each its even split of the train split.

  Yields (stream, its tokenized pairs, counts {'read', 'empty', 'long'}) one stream at a time,
  reading and tokenizing READ_CHUNK_PAIRS pairs at a time; drops pairs with an empty side and
  pairs longer than config.data.max_length tokens (EOS included). `builder`: the prepared
  builder of config.data.dataset_name (`prepared_builder`).
  """
  current, collector = None, None
  for stream, src, tgt in _stream_chunks(builder, config, streams, num_streams):
    if stream != current:
      if collector is not None:
        yield current, collector.pairs(), collector.counts
      current, collector = stream, _PairCollector(tokenizer, config.data.max_length)
    collector.add(src, tgt)
  if collector is not None:
    yield current, collector.pairs(), collector.counts


def build_rows(pairs: TokenizedPairs, members: np.ndarray, pairs_per_row: np.ndarray,
               num_rows: int, max_length: int) -> dict[str, np.ndarray]:
  """Packed rows as the six int32 arrays [num_rows, max_length] (keys FEATURE_KEYS).

  Each pair is one segment of its row (ids 1, 2, ... in row order; positions restart at 0 per
  segment), its source in 'inputs', its target in 'targets'; then padding (all fields 0).

  Args:
    members: [m] pair indices, row after row, each row's in segment order.
    pairs_per_row: [rows] how many of `members` each row holds, rows <= num_rows; the rows
      after them are all padding.
  """
  pairs_per_row = np.asarray(pairs_per_row, np.int64)
  first = np.cumsum(pairs_per_row) - pairs_per_row  # [rows] index of each row's first member.
  row_of_member = np.repeat(np.arange(len(pairs_per_row)), pairs_per_row)
  segment = _positions(pairs_per_row) + 1
  out = {}
  for side in ('inputs', 'targets'):
    tokens, offsets = pairs.side(side)
    lengths = offsets[members + 1] - offsets[members]
    begins = np.cumsum(lengths) - lengths
    column = begins - np.repeat(begins[first], pairs_per_row)  # [m] first column of each pair.
    position = _positions(lengths)
    rows = np.repeat(row_of_member, lengths)
    cols = np.repeat(column, lengths) + position
    for key, values in ((side, tokens[np.repeat(offsets[members], lengths) + position]),
                        (side + '_segmentation', np.repeat(segment, lengths)),
                        (side + '_positions', position)):
      out[key] = np.zeros((num_rows, max_length), np.int32)
      out[key][rows, cols] = values
  return {k: out[k] for k in FEATURE_KEYS}


# ----------------------------------------------------------------------------- streams


@dataclasses.dataclass(frozen=True)
class EpochRows:
  """One stream-epoch's packing: rows of pair indices, kept flat.

  Fields: pair_order [pairs] int64, row after row; row_offsets [rows + 1] int64 (row r is
  pair_order[row_offsets[r]:row_offsets[r + 1]]); num_batches: steps of rows_per_step rows
  (the last topped up with padding rows); packing_efficiency: real tokens / token slots.
  """

  pair_order: np.ndarray
  row_offsets: np.ndarray
  num_batches: int
  packing_efficiency: float


class TrainStream:
  """One stream: an endless, resumable sequence of packed rows over its own pairs.

  Epoch e: a permutation of the stream's pairs seeded by (seed, stream, e), packed best-fit
  (`pack_rows`) in windows of `window` pairs, each window's rows shuffled. Each step takes
  `rows_per_step` rows; the epoch's last step is topped up with all-padding rows (never rows
  of the next epoch), so every pair appears exactly once per stream-epoch and an epoch depends
  on nothing but (seed, stream, epoch) and the pairs.
  """

  def __init__(self, pairs: TokenizedPairs, *, stream: int, seed: int, rows_per_step: int,
               max_length: int, window: int, pool: concurrent.futures.Executor,
               epoch: int = 0, batch_in_epoch: int = 0):
    if not pairs.num_pairs:
      raise DataError(f'Train stream {stream} has no pairs left after filtering: use fewer '
                      'streams (config.data.num_streams) or a larger train split.')
    self.pairs, self.stream = pairs, stream
    self._seed, self._rows_per_step = seed, rows_per_step
    self._max_length, self._window, self._pool = max_length, window, pool
    self._real_tokens = len(pairs.source_tokens) + len(pairs.target_tokens)
    self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
    self.rows = self.pack_epoch(epoch)
    if not 0 <= batch_in_epoch <= self.rows.num_batches:
      raise DataError(f'State position [{epoch}, {batch_in_epoch}] of train stream {stream} is '
                      f'outside its epoch of {self.rows.num_batches} batches (different data or '
                      'config?).')
    self._next_rows: concurrent.futures.Future | None = None

  def pack_epoch(self, epoch: int) -> EpochRows:
    """Packs epoch `epoch` of this stream (cost: best-fit over every pair of the stream)."""
    rng = np.random.default_rng([self._seed, self.stream, epoch])
    perm = rng.permutation(self.pairs.num_pairs)
    src_lens, tgt_lens = self.pairs.source_lengths, self.pairs.target_lengths
    orders, sizes = [], []
    for start in range(0, len(perm), self._window):
      order, offsets = pack_rows(src_lens, tgt_lens, perm[start:start + self._window],
                                 self._max_length)
      shuffled = rng.permutation(len(offsets) - 1)
      size = np.diff(offsets)[shuffled]
      orders.append(order[np.repeat(offsets[shuffled], size) + _positions(size)])
      sizes.append(size)
    row_offsets = np.zeros(sum(len(s) for s in sizes) + 1, np.int64)
    np.cumsum(np.concatenate(sizes), out=row_offsets[1:])
    num_batches = -(-(len(row_offsets) - 1) // self._rows_per_step)
    efficiency = self._real_tokens / (2 * num_batches * self._rows_per_step * self._max_length)
    logging.debug('Stream %d epoch %d: %d pairs in %d rows (%d batches), packing efficiency '
                  '%.1f%%.', self.stream, epoch, len(perm), len(row_offsets) - 1, num_batches,
                  100 * efficiency)
    return EpochRows(np.concatenate(orders), row_offsets, num_batches, efficiency)

  @property
  def position(self) -> tuple[int, int]:
    """(epoch, batch_in_epoch) of the next batch."""
    if self.batch_in_epoch >= self.rows.num_batches:
      return self.epoch + 1, 0
    return self.epoch, self.batch_in_epoch

  def next_rows(self) -> dict[str, np.ndarray]:
    """The next step's rows: the six fields, int32 [rows_per_step, max_length]."""
    if self._next_rows is None:  # Packs the next epoch while this one is read.
      self._next_rows = self._pool.submit(self.pack_epoch, self.epoch + 1)
    if self.batch_in_epoch >= self.rows.num_batches:
      self.rows = self._next_rows.result()
      self.epoch, self.batch_in_epoch = self.epoch + 1, 0
      self._next_rows = self._pool.submit(self.pack_epoch, self.epoch + 1)
    offsets = self.rows.row_offsets
    first = self.batch_in_epoch * self._rows_per_step
    last = min(first + self._rows_per_step, len(offsets) - 1)
    self.batch_in_epoch += 1
    return build_rows(self.pairs, self.rows.pair_order[offsets[first]:offsets[last]],
                      np.diff(offsets[first:last + 1]), self._rows_per_step, self._max_length)

  def close(self) -> None:
    if self._next_rows is not None:
      self._next_rows.cancel()


def check_streams(config, process_count: int) -> int:
  """Rows each stream gives per step; DataError if the streams do not fit the batch or hosts."""
  data = config.data
  num_streams, batch_size = data.num_streams, data.batch_size
  if num_streams < 1 or batch_size % num_streams:
    raise DataError(f'data.batch_size={batch_size} rows do not divide over data.num_streams='
                    f'{num_streams} streams; set data.num_streams to a divisor of {batch_size}.')
  if num_streams % process_count:
    raise DataError(f'data.num_streams={num_streams} streams do not divide over {process_count} '
                    f'processes; set data.num_streams to a multiple of {process_count}.')
  return batch_size // num_streams


def start_positions(state: dict | None, num_streams: int) -> list[list[int]]:
  """[epoch, batch_in_epoch] for every stream from a saved state (None: all at [0, 0]).

  A state of this design with this num_streams maps exactly (positions of streams another
  process owned may be [-1, -1]). A state of the single-stream format ({'epoch',
  'batch_in_epoch'}) or of another num_streams cannot: every stream then starts a fresh epoch,
  after the newest one the state names, with a warning.
  """
  if not state:
    return [[0, 0] for _ in range(num_streams)]
  if 'positions' in state and state.get('num_streams') == num_streams:
    positions = [[int(e), int(b)] for e, b in state['positions']]
    if len(positions) != num_streams:
      raise DataError(f'Data state has {len(positions)} stream positions for num_streams='
                      f'{num_streams}.')
    return positions
  if 'positions' in state:
    epochs = [int(e) + (int(b) > 0) for e, b in state['positions']]
    why = f"was written with data.num_streams={state.get('num_streams')}, not {num_streams}"
  elif 'epoch' in state:
    epochs = [int(state['epoch']) + (int(state.get('batch_in_epoch', 0)) > 0)]
    why = 'is of the single-stream format (one epoch and batch for all data)'
  else:
    raise DataError(f'Unrecognised data state {state!r}: expected num_streams and positions.')
  epoch = max(epochs)
  logging.warning('The checkpoint\'s data state %s: it cannot be mapped exactly onto these '
                  'streams, so every stream starts a fresh epoch (%d); the data order from here '
                  'differs from an uninterrupted run.', why, epoch)
  return [[epoch, 0] for _ in range(num_streams)]


class TrainIterator:
  """Endless, resumable stream of packed batches for one process: its streams' rows.

  Process p of P runs streams [p * S / P, (p + 1) * S / P) of S = num_streams; a step's
  batch is their rows in stream order, the contiguous slice p of the global batch.
  """

  def __init__(self, streams: Sequence[TrainStream], *, num_streams: int,
               pool: concurrent.futures.ThreadPoolExecutor):
    self.streams, self.num_streams, self._pool = list(streams), num_streams, pool
    self.setup_seconds: dict[str, float] = {}  # What building it cost: reading, packing.

  @property
  def epoch_batches(self) -> list[int]:
    """Batches of each of this process's streams in the epoch it is in."""
    return [s.rows.num_batches for s in self.streams]

  @property
  def packing_efficiency(self) -> float:
    """Real tokens / token slots over this process's streams' current epochs."""
    real = sum(s.rows.packing_efficiency * s.rows.num_batches for s in self.streams)
    return real / sum(self.epoch_batches)

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """Dict of the 6 fields, int32 [batch_size // process_count, max_length]."""
    parts = [s.next_rows() for s in self.streams]
    return {k: np.concatenate([p[k] for p in parts]) for k in FEATURE_KEYS}

  def get_state(self) -> dict[str, Any]:
    """JSON-able position after the last returned batch.

    {'num_streams': S, 'positions': [[epoch, batch_in_epoch] for each of the S streams]}, with
    [-1, -1] for the streams other processes run: the elementwise max over every process's
    state is the whole run's state, which `make_train_iterator(state=...)` takes on any number
    of processes. With one process it is whole already.
    """
    positions = [[-1, -1] for _ in range(self.num_streams)]
    for s in self.streams:
      positions[s.stream] = list(s.position)
    return {'num_streams': self.num_streams, 'positions': positions}

  def close(self) -> None:
    for s in self.streams:
      s.close()
    self._pool.shutdown(wait=False, cancel_futures=True)


def _cached_stream_path(cache_dir: str, builder: tfds.core.DatasetBuilder, config,
                        tokenizer: Tokenizer, stream: int, num_streams: int) -> str:
  """Where a stream's tokenized pairs are kept; the name fingerprints what they depend on."""
  data = config.data
  h = hashlib.sha256(tokenizer.fingerprint.encode())
  for part in (builder.info.full_name, builder.info.splits[data.train_split].num_examples,
               data.train_split, data.source_lang, data.target_lang, data.max_length):
    h.update(f'|{part}'.encode())
  return os.path.join(cache_dir, f'stream_{stream}_of_{num_streams}_{h.hexdigest()[:16]}.npz')


def _load_cached_stream(path: str) -> tuple[TokenizedPairs, dict[str, int]]:
  with np.load(path) as f:
    pairs = TokenizedPairs(*(f[field.name] for field in dataclasses.fields(TokenizedPairs)))
    return pairs, {k: int(f[k]) for k in ('read', 'empty', 'long')}


def _save_cached_stream(path: str, pairs: TokenizedPairs, counts: dict[str, int]) -> None:
  """Writes atomically and removes the stream's files of other fingerprints."""
  folder, name = os.path.split(path)
  os.makedirs(folder, exist_ok=True)
  prefix = name[:name.rindex('_') + 1]
  for old in os.listdir(folder):
    if old.startswith(prefix) and old != name:
      os.remove(os.path.join(folder, old))
  tmp = f'{path}.tmp{os.getpid()}.npz'
  np.savez(tmp, **dataclasses.asdict(pairs), **counts)
  os.replace(tmp, path)


def make_train_iterator(config, tokenizer: Tokenizer, *, process_index: int = 0,
                        process_count: int = 1, state: dict | None = None,
                        cache_dir: str | None = None) -> TrainIterator:
  """Reads, tokenizes and packs this process's streams of the train split.

  Process p of P reads only the S / P even splits of its streams (S = config.data.num_streams),
  drops pairs longer than max_length, and packs each stream's current epoch: the iterator's
  first batch costs reading, tokenizing and packing one epoch of 1 / P of the data, and so does
  resuming from `state` (a merged state, see `TrainIterator.get_state`; positions beyond an
  epoch are a DataError). With `cache_dir` (e.g. a folder of the workdir, which the tokenizer
  also lives in), each stream's tokenized pairs are kept there and read back by later
  iterators, so a resume costs loading them and packing one epoch. `config.data.shuffle_buffer`
  is the packing window in pairs (pairs are permuted over the whole stream first, so the
  shuffle itself is uniform whatever the window).
  """
  data = config.data
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index {process_index} not in [0, {process_count}).')
  rows_per_step = check_streams(config, process_count)
  num_streams = data.num_streams
  positions = start_positions(state, num_streams)
  per_process = num_streams // process_count
  own = range(process_index * per_process, (process_index + 1) * per_process)
  missing = [s for s in own if min(positions[s]) < 0]
  if missing:
    raise DataError(f'Data state has no position for streams {missing}: it is one process\'s '
                    'part; merge every process\'s get_state() by elementwise max.')
  builder = prepared_builder(config, process_index=process_index)
  _check_split(builder, config, data.train_split)
  cached = {s: _cached_stream_path(cache_dir, builder, config, tokenizer, s, num_streams)
            for s in own} if cache_dir else {}
  cached = {s: path for s, path in cached.items() if os.path.isfile(path)}
  reading = read_streams(builder, config, tokenizer, [s for s in own if s not in cached],
                         num_streams)
  pool = concurrent.futures.ThreadPoolExecutor(1)
  streams, totals = [], {'read': 0, 'empty': 0, 'long': 0}
  seconds = {'read_and_tokenize': 0.0, 'pack': 0.0}
  for s in own:
    start = time.perf_counter()
    if s in cached:
      pairs, counts = _load_cached_stream(cached[s])
    else:
      _, pairs, counts = next(reading)
      if cache_dir:
        _save_cached_stream(_cached_stream_path(cache_dir, builder, config, tokenizer, s,
                                                num_streams), pairs, counts)
    totals = {k: totals[k] + counts[k] for k in totals}
    epoch, batch = positions[s]
    packing = time.perf_counter()
    streams.append(TrainStream(pairs, stream=s, seed=config.seed, rows_per_step=rows_per_step,
                               max_length=data.max_length, window=data.shuffle_buffer,
                               pool=pool, epoch=epoch, batch_in_epoch=batch))
    seconds['read_and_tokenize'] += packing - start
    seconds['pack'] += time.perf_counter() - packing
  if totals['empty']:
    logging.warning('%s/%s: skipped %d pairs with an empty side.', data.dataset_name,
                    data.train_split, totals['empty'])
  logging.info('Dropped %d of %d training pairs longer than max_length=%d tokens (incl. EOS).',
               totals['long'], totals['read'] - totals['empty'], data.max_length)
  it = TrainIterator(streams, num_streams=num_streams, pool=pool)
  it.setup_seconds = seconds
  logging.info('Train streams %d-%d of %d: %d pairs, %d rows per step, packing efficiency '
               '%.1f%%; %s in %.1f s, packed in %.1f s.', own[0], own[-1], num_streams,
               sum(s.pairs.num_pairs for s in streams), rows_per_step * len(streams),
               100 * it.packing_efficiency,
               f'{len(cached)} streams loaded from {cache_dir}, {len(own) - len(cached)} read '
               'and tokenized' if cache_dir else 'read and tokenized',
               seconds['read_and_tokenize'], seconds['pack'])
  return it
