"""Input pipeline: TFDS sources, joint sentencepiece BPE, packed training batches.

Sources (`config.data.dataset_name`), all read through TFDS / tf.data:
  * any TFDS translation dataset, e.g. 'wmt14_translate/de-en';
  * 'multi30k': the project's own builder below (Multi30k task 1, en/de/fr);
  * 'folder:/path': aligned plain-text files `{split}.{lang}` (e.g. train.en, train.de).

Raw text is read once per split, tokenized in one vectorised sentencepiece call and kept
in memory as int32 arrays. Training rows are then packed in numpy, one epoch at a time
(the next epoch is packed in a background thread), which makes the stream exactly
reproducible from (seed, epoch, batch_in_epoch) without checkpointing tf.data state.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import io
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import sentencepiece as spm
import tensorflow_datasets as tfds
from absl import logging

from model import EOS_ID, PAD_ID, UNK_ID

MULTI30K_ENV = 'MULTI30K_DIR'
FEATURE_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
                'inputs_positions', 'targets_positions')


class DataError(ValueError):
  """Bad or missing input data; the message says which file/split and what to do."""


class MissingDataError(DataError, FileNotFoundError):
  """A file, folder or split that should exist does not."""


# ----------------------------------------------------------------------------- raw text


def read_lines(path: str | os.PathLike) -> list[str]:
  """Lines of a UTF-8 text file ('-': stdin) without line endings; errors name file and line."""
  path = os.fspath(path)
  if path == '-':
    path, data = 'stdin', sys.stdin.buffer.read()
  elif not os.path.isfile(path):
    raise MissingDataError(f'{path}: file not found.')
  else:
    with open(path, 'rb') as f:
      data = f.read()
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    raise DataError(f'{path}:{line}: invalid UTF-8 ({e.reason} at byte {e.start}); '
                    'convert the file to UTF-8, e.g. `iconv -f LATIN1 -t UTF-8`.') from None
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()  # Trailing newline of the last line.
  return [line.rstrip('\r') for line in lines]


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


def read_split(config, split: str) -> tuple[list[str], list[str]]:
  """All (source, target) texts of a split, in dataset order, whitespace-stripped.

  Pairs with an empty side are dropped (and counted) for `config.data.train_split` only;
  evaluation splits keep them so that outputs stay aligned with reference files.
  """
  builder = _builder(config)
  config = config.data
  src_lang, tgt_lang = config.source_lang, config.target_lang
  if isinstance(builder, ParallelTextFolder) and split not in builder.splits():
    read_parallel_files(builder._folder, split, (src_lang, tgt_lang))  # Raises naming files.
  langs = list(builder.info.features.keys())  # Known before (a long) prepare.
  for lang in (src_lang, tgt_lang):
    if lang not in langs:
      raise DataError(f'Language {lang!r} not in {config.dataset_name!r} (has {langs}); '
                      'check config.data.source_lang / config.data.target_lang.')
  if not builder.is_prepared():
    logging.info('Preparing %s in %s (once; later runs read it from there).',
                 config.dataset_name, builder.data_dir)
  builder.download_and_prepare()
  if split not in builder.info.splits:
    raise MissingDataError(f'Split {split!r} not in {config.dataset_name!r}; available: '
                           f'{sorted(builder.info.splits)}.')
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(8192)
  src, tgt = [], []
  for batch in tfds.as_numpy(ds):
    src.extend(s.decode('utf-8').strip() for s in batch[src_lang])
    tgt.extend(t.decode('utf-8').strip() for t in batch[tgt_lang])
  empty = sum(1 for s, t in zip(src, tgt, strict=True) if not s or not t)
  if empty and split == config.train_split:
    keep = [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]
    src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    logging.warning('%s/%s: skipped %d pairs with an empty side.', config.dataset_name, split,
                    empty)
  elif empty:
    logging.warning('%s/%s: %d pairs have an empty side (kept).', config.dataset_name, split,
                    empty)
  logging.info('%s/%s: %d pairs.', config.dataset_name, split, len(src))
  return src, tgt


# ----------------------------------------------------------------------------- tokenizer


class Tokenizer:
  """Joint sentencepiece model; ids: PAD 0, EOS 1, UNK 2, no BOS; byte fallback."""

  def __init__(self, sp: spm.SentencePieceProcessor):
    self._sp = sp
    self.vocab_size = sp.get_piece_size()

  def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Int32 id arrays [len_i], each ending with EOS_ID (one batched C++ call)."""
    ids = self._sp.encode(list(texts), out_type=int, add_eos=True)
    return [np.asarray(x, np.int32) for x in ids]

  def decode(self, ids) -> str:
    """One sequence [len]: stops at the first EOS, ignores PAD."""
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == EOS_ID:
        break
      if i != PAD_ID and 0 <= i < self.vocab_size:
        out.append(i)
    return self._sp.decode(out)

  def decode_batch(self, ids_2d) -> list[str]:
    """[batch, len] -> batch strings."""
    return [self.decode(row) for row in np.asarray(ids_2d)]


def load_tokenizer(path: str) -> Tokenizer:
  if not os.path.isfile(path):
    raise MissingDataError(f'{path}: tokenizer model not found.')
  return Tokenizer(spm.SentencePieceProcessor(model_file=path))


def load_or_train_tokenizer(config, workdir: str) -> Tokenizer:
  """Loads workdir/tokenizer.model, or trains it on a seeded sample of the train split.

  Its vocabulary is config.model.vocab_size. Deterministic: the sample (at most
  config.data.spm_sample_size sentences of both sides) is fed in corpus order and trained
  single-threaded, so same data + seed = same bytes.
  """
  path = os.path.join(workdir, 'tokenizer.model')
  vocab_size = config.model.vocab_size
  if os.path.isfile(path):
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != vocab_size:
      raise DataError(f'{path} has {tokenizer.vocab_size} pieces but config.model.vocab_size is '
                      f'{vocab_size}: use a new workdir, or set the vocabulary size to match.')
    logging.info('Using existing tokenizer %s.', path)
    return tokenizer
  src, tgt = read_split(config, config.data.train_split)
  texts = src + tgt
  sample_size = config.data.spm_sample_size
  if len(texts) > sample_size:
    rng = np.random.default_rng(config.seed)
    keep = np.sort(rng.choice(len(texts), sample_size, replace=False))
    texts = [texts[i] for i in keep]
  os.makedirs(workdir, exist_ok=True)
  model = io.BytesIO()
  # Sentences from an iterator and the model into memory: no file paths end up in the
  # model's trainer spec, so the bytes depend only on the data, seed and settings.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, model_type='bpe',
      vocab_size=vocab_size, character_coverage=1.0, byte_fallback=True,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
      # Identity normalisation keeps decode(encode(s)) == s (NFKC would rewrite text).
      normalization_rule_name='identity', remove_extra_whitespaces=False,
      input_sentence_size=0, shuffle_input_sentence=False, num_threads=1, minloglevel=2)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(model.getvalue())
  os.replace(tmp, path)  # Atomic: a concurrent reader never sees half a file.
  logging.info('Trained %d-piece BPE tokenizer on %d sentences: %s', vocab_size,
               len(texts), path)
  return load_tokenizer(path)


# ----------------------------------------------------------------------------- packing


def pack_rows(src_lens: np.ndarray, tgt_lens: np.ndarray, order: np.ndarray,
              max_length: int) -> list[list[int]]:
  """Best-fit-decreasing packing of pairs into rows of max_length tokens per side.

  Open rows are indexed by their remaining (source, target) room in a
  [max_length + 1]^2 grid, so each placement costs O(max_length^2), not O(#rows).

  Args:
    src_lens, tgt_lens: [num_pairs] token counts (incl. EOS), each <= max_length.
    order: pair indices to pack (their order breaks length ties).
  Returns:
    Rows, each a list of pair indices in segment order.
  """
  size = src_lens[order] + tgt_lens[order]
  order = order[np.argsort(-size, kind='stable')]
  room = np.arange(max_length + 1)
  slack = room[:, None] + room[None, :]  # Leftover room if a row with (rs, rt) is used.
  counts = np.zeros((max_length + 1, max_length + 1), np.int64)
  buckets: dict[tuple[int, int], list[int]] = {}
  rows: list[list[int]] = []
  big = 4 * max_length + 1
  for p in order.tolist():
    a, b = int(src_lens[p]), int(tgt_lens[p])
    cand = np.where(counts[a:, b:] > 0, slack[a:, b:], big)
    k = int(cand.argmin())
    if cand.flat[k] == big:
      r, rs, rt = len(rows), max_length - a, max_length - b
      rows.append([p])
    else:
      i, j = divmod(k, cand.shape[1])
      counts[a + i, b + j] -= 1
      r = buckets[(a + i, b + j)].pop()
      rows[r].append(p)
      rs, rt = i, j
    counts[rs, rt] += 1
    buckets.setdefault((rs, rt), []).append(r)
  return rows


def build_packed_arrays(src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray],
                        rows: Sequence[Sequence[int]], max_length: int,
                        num_rows: int | None = None) -> dict[str, np.ndarray]:
  """Materialises rows of pair indices as int32 arrays [num_rows, max_length].

  Rows beyond len(rows) (up to num_rows) are all padding.
  """
  n = max(num_rows or 0, len(rows))
  out = {k: np.zeros((n, max_length), np.int32) for k in FEATURE_KEYS}
  for r, row in enumerate(rows):
    for side, ids in (('inputs', src_ids), ('targets', tgt_ids)):
      pos = 0
      for seg, p in enumerate(row, 1):
        x = ids[p]
        out[side][r, pos:pos + len(x)] = x
        out[side + '_segmentation'][r, pos:pos + len(x)] = seg
        out[side + '_positions'][r, pos:pos + len(x)] = np.arange(len(x))
        pos += len(x)
  return out


def rows_per_host(batch_size: int, process_count: int) -> int:
  """Each host's share of a global batch of `batch_size` rows; they must divide evenly."""
  if batch_size % process_count:
    raise DataError(f'batch_size={batch_size} rows do not divide over {process_count} hosts; '
                    f'use a multiple of {process_count}.')
  return batch_size // process_count


class TrainIterator:
  """Endless, resumable stream of packed batches for one process.

  Each epoch: a permutation of all pairs seeded by (seed, epoch), packed (best fit) in
  windows of `window` pairs, rows shuffled; the last global batch is topped up with
  all-padding rows so every pair appears exactly once per epoch. Every process packs
  the same global rows and takes its own contiguous slice of each global batch.
  Resuming packs the state's epoch again; no batches are replayed.
  """

  def __init__(self, src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray], *,
               batch_size: int, max_length: int, seed: int, window: int,
               process_index: int = 0, process_count: int = 1, epoch: int = 0,
               batch_in_epoch: int = 0):
    self._local = rows_per_host(batch_size, process_count)
    if not 0 <= process_index < process_count:
      raise DataError(f'process_index {process_index} not in [0, {process_count}).')
    if not src_ids:
      raise DataError('No training pairs left after filtering.')
    self._src, self._tgt = src_ids, tgt_ids
    self._src_lens = np.array([len(x) for x in src_ids], np.int64)
    self._tgt_lens = np.array([len(x) for x in tgt_ids], np.int64)
    self._batch_size, self._max_length = batch_size, max_length
    self._seed, self._window = seed, window
    self._offset = process_index * self._local
    self._pool = concurrent.futures.ThreadPoolExecutor(1)  # Packs the next epoch meanwhile.
    self._epoch, self._batch = epoch, batch_in_epoch
    self._arrays, self.packing_efficiency = self._pack_epoch(epoch)
    if not 0 <= batch_in_epoch <= self.num_batches:
      raise DataError(f'State batch_in_epoch={batch_in_epoch} outside epoch of '
                      f'{self.num_batches} batches (different data or config?).')
    self._next = self._pool.submit(self._pack_epoch, epoch + 1)

  @property
  def num_batches(self) -> int:
    """Batches per epoch (the same on every process)."""
    return len(self._arrays['inputs']) // self._batch_size

  def _pack_epoch(self, epoch: int) -> tuple[dict[str, np.ndarray], float]:
    rng = np.random.default_rng([self._seed, epoch])
    perm = rng.permutation(len(self._src))
    rows = []
    for start in range(0, len(perm), self._window):
      window_rows = pack_rows(self._src_lens, self._tgt_lens, perm[start:start + self._window],
                              self._max_length)
      rows.extend(window_rows[i] for i in rng.permutation(len(window_rows)))
    num_rows = -(-len(rows) // self._batch_size) * self._batch_size
    arrays = build_packed_arrays(self._src, self._tgt, rows, self._max_length, num_rows)
    real = int(self._src_lens.sum() + self._tgt_lens.sum())
    efficiency = real / (2 * num_rows * self._max_length)
    logging.info('Epoch %d: %d pairs in %d rows (%d batches), packing efficiency %.1f%%.',
                 epoch, len(perm), num_rows, num_rows // self._batch_size, 100 * efficiency)
    return arrays, efficiency

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """Dict of the 6 fields, int32 [batch_size // process_count, max_length]."""
    if self._batch >= self.num_batches:
      self._arrays, self.packing_efficiency = self._next.result()
      self._epoch, self._batch = self._epoch + 1, 0
      self._next = self._pool.submit(self._pack_epoch, self._epoch + 1)
    start = self._batch * self._batch_size + self._offset
    self._batch += 1
    return {k: v[start:start + self._local].copy() for k, v in self._arrays.items()}

  def get_state(self) -> dict[str, int]:
    """JSON-able position after the last returned batch."""
    if self._batch >= self.num_batches:
      return {'epoch': self._epoch + 1, 'batch_in_epoch': 0}
    return {'epoch': self._epoch, 'batch_in_epoch': self._batch}

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


def make_train_iterator(config, tokenizer: Tokenizer, *, process_index: int = 0,
                        process_count: int = 1, state: dict | None = None) -> TrainIterator:
  """Tokenizes the train split once, drops pairs longer than max_length, packs batches.

  `config.data.shuffle_buffer` is the packing window in pairs (pairs are permuted globally
  first, so the shuffle itself is uniform whatever the window).
  """
  data = config.data
  src, tgt = read_split(config, data.train_split)
  src_ids, tgt_ids = tokenizer.encode(src), tokenizer.encode(tgt)
  keep = [i for i in range(len(src_ids))
          if len(src_ids[i]) <= data.max_length and len(tgt_ids[i]) <= data.max_length]
  logging.info('Dropped %d of %d training pairs longer than max_length=%d tokens (incl. EOS).',
               len(src_ids) - len(keep), len(src_ids), data.max_length)
  state = state or {}
  return TrainIterator(
      [src_ids[i] for i in keep], [tgt_ids[i] for i in keep], batch_size=data.batch_size,
      max_length=data.max_length, seed=config.seed, window=data.shuffle_buffer,
      process_index=process_index, process_count=process_count,
      epoch=int(state.get('epoch', 0)), batch_in_epoch=int(state.get('batch_in_epoch', 0)))


# ----------------------------------------------------------------------------- evaluation


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
    for name, seqs in sides.items():
      long = [i for i, x in enumerate(seqs) if len(x) > max_length]
      if long:
        logging.warning('Truncating %d %s sequences longer than %d tokens (indices %s...).',
                        len(long), name, max_length, long[:10])
      for i in long:
        seqs[i] = np.append(np.asarray(seqs[i][:max_length - 1]), EOS_ID)
  count = len(next(iter(sides.values())))
  longest = [max(len(seqs[i]) for seqs in sides.values()) for i in range(count)]
  padded = [max(1, -(-n // length_multiple) * length_multiple) for n in longest]
  order = np.argsort(np.array(padded, np.int64), kind='stable')
  def padded_rows(count: int) -> int:
    rows = max(row_multiple, 1 << (count - 1).bit_length())
    return -(-rows // row_multiple) * row_multiple

  groups: list[list[int]] = []
  for i in order.tolist():
    # Sorted ascending, so the newest member sets the padded length.
    if groups and padded_rows(len(groups[-1]) + 1) * padded[i] <= max_batch_tokens:
      groups[-1].append(i)
    else:
      if padded[i] > max_batch_tokens:
        logging.warning('Sequence %d (%d tokens) exceeds max_batch_tokens=%d; alone.',
                        i, longest[i], max_batch_tokens)
      groups.append([i])
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
