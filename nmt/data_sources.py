"""Parallel text through TFDS, prepared once and read one way.

Every source (`config.data.dataset_name`) is a TFDS builder: a TFDS translation dataset (e.g.
'wmt14_translate/de-en'), 'multi30k' (`Multi30k`) or 'folder:/path' (`ParallelTextFolder`,
aligned `{split}.{lang}` files, streamed). Process 0 prepares it as array_record
(`prepared_builder`; the other processes wait). `PairSource` reads any split or sub-split of it
by index, without TensorFlow: each record a tf.train.Example parsed with TFDS's compiled proto.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import tensorflow_datasets as tfds
from absl import logging

from nmt import text_io
from nmt.text_io import DataError, MissingDataError

MULTI30K_ENV = 'MULTI30K_DIR'
# How processes other than 0 wait for what process 0 makes (a tokenizer, prepared data; WMT14
# takes hours to prepare): a process 0 that dies meanwhile ends the job by JAX's heartbeat.
WAIT_POLL_SECONDS = 1.0
WAIT_LOG_SECONDS = 30.0
WAIT_TIMEOUT_SECONDS = 24 * 3600.0
# Serialized records TFDS keeps in memory while preparing, before it spills them to files.
PREPARE_BUFFER_BYTES = 64 << 20


def check_files(folder: str, split: str, langs: Sequence[str]) -> dict[str, str]:
  """{lang: path} of `{folder}/{split}.{lang}`; MissingDataError naming what is missing."""
  paths = {lang: os.path.join(folder, f'{split}.{lang}') for lang in langs}
  missing = [p for p in paths.values() if not os.path.isfile(p)]
  if missing:
    raise MissingDataError(
        f'Missing {", ".join(missing)}: split {split!r} needs one aligned file per language '
        f'({", ".join(os.path.basename(p) for p in paths.values())}) in {folder}.')
  return paths


def stream_pairs(paths: dict[str, str]) -> Iterator[tuple[int, dict[str, str]]]:
  """(key, {lang: line}) for each line of aligned files {lang: path}, read as a stream
  (`text_io.stream_lines`: UTF-8 errors name file and line). Keys increase with the line over
  TFDS's 128-bit key space: its shuffler spills records to files by key range, and small keys
  would all land in one, which it then sorts in memory."""
  counts = {}
  for path in paths.values():  # Lines as `text_io.stream_lines` counts them.
    with open(path, 'rb') as f:
      counts[path] = sum(1 for _ in f)
  if len(set(counts.values())) > 1:
    raise DataError(f'Line counts differ: {counts}. Files of a split must be aligned line '
                    'by line (line n of one translates line n of the other); fix the files.')
  stride = (1 << 128) // max(1, next(iter(counts.values())))
  with contextlib.ExitStack() as stack:
    files = [stack.enter_context(open(path, 'rb')) for path in paths.values()]
    lines = [itertools.chain.from_iterable(text_io.stream_lines(f.fileno(), name=f.name))
             for f in files]
    for i, texts in enumerate(zip(*lines)):
      yield i * stride, dict(zip(paths, texts))


def _fingerprint(folder: str, names: Sequence[str], *parts: str) -> str:
  """Of a folder's path and its files' sizes and modification times: editing the files makes
  another builder config name, so TFDS prepares a fresh copy."""
  h = hashlib.sha256('|'.join([os.path.abspath(folder), *parts]).encode())
  for name in names:
    path = os.path.join(folder, name)
    st = os.stat(path) if os.path.isfile(path) else None
    h.update(f'{name}:{st and st.st_size}:{st and st.st_mtime_ns}'.encode())
  return h.hexdigest()[:16]


class AlignedText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A builder of aligned text files, one per language of each split, in file order."""

  VERSION = tfds.core.Version('2.0.0')
  RELEASE_NOTES = {'2.0.0': 'Prepared as array_record, files streamed.'}
  code_path = None  # No url checksums file (TFDS would look for one beside this module).
  HOMEPAGE: str | None = None
  langs: tuple[str, ...]  # Of each split; set by the subclass.

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__, homepage=self.HOMEPAGE,
        disable_shuffling=True,  # Keep file order.
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in self.langs}))

  def _generate_examples(self, paths: dict[str, str]):
    return stream_pairs(paths)


class ParallelTextFolder(AlignedText, skip_registration=True):
  """Aligned `{split}.{lang}` text files in a folder; every split with all languages."""

  def __init__(self, *, folder: str, languages: Sequence[str], **kwargs: Any):
    self.folder, self.langs = os.path.abspath(folder), tuple(languages)
    if not os.path.isdir(self.folder):
      raise MissingDataError(f'{folder}: dataset folder not found (config.data.dataset_name '
                             "'folder:<dir>' must name a folder with train.en, train.de, ...).")
    files = [f'{s}.{lang}' for s in self.splits() for lang in self.langs]
    name = '_'.join(self.langs) + '_' + _fingerprint(self.folder, files, *self.langs)
    super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

  def splits(self) -> list[str]:
    """File stems that exist for every language."""
    stems = [set(f[:-len(lang) - 1] for f in os.listdir(self.folder) if f.endswith('.' + lang))
             for lang in self.langs]
    return sorted(set.intersection(*stems))

  def _split_generators(self, dl_manager):
    return {s: self._generate_examples(check_files(self.folder, s, self.langs))
            for s in self.splits()}


class Multi30k(AlignedText, skip_registration=True):
  """Multi30k task 1 (Flickr30k captions), multi-way aligned en/de/fr: a local copy of the
  unzipped release files when `local_dir` is given (no network; a file that differs from the
  release is a warning; a fingerprint of the files names the builder config), else the gzip'd
  originals, downloaded, gunzipped by TFDS and checked by sha256."""

  HOMEPAGE = 'https://github.com/multi30k/dataset'
  SPLITS = ('train', 'val', 'test_2016_flickr')
  langs = ('en', 'de', 'fr')
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
    name = 'local_' + _fingerprint(local_dir, self.SHA256) if local_dir else 'release'
    super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

  def _split_generators(self, dl_manager):
    local = self._local_dir
    files = ({name: os.path.join(local, name) for name in self.SHA256} if local else
             self._download(dl_manager))
    missing = [name for name, path in files.items() if not os.path.isfile(path)]
    if missing:
      raise MissingDataError(
          f'Multi30k local copy {local} lacks {", ".join(missing)}. Put the unzipped task-1 '
          f'files {", ".join(self.SHA256)} there (from {self.URL.format("{split}.{lang}")}).')
    changed = [name for name, digest in self.SHA256.items()
               if hashlib.sha256(Path(files[name]).read_bytes()).hexdigest() != digest]
    if changed and not local:
      raise DataError(f'{", ".join(changed)}: sha256 mismatch after gunzip of the download from '
                      f'{self.URL.format("...")}; the download is corrupt or the release changed.')
    for name in changed:
      logging.warning('%s differs from the Multi30k release file (sha256).', name)
    return {s: self._generate_examples({lang: files[f'{s}.{lang}'] for lang in self.langs})
            for s in self.SPLITS}

  def _download(self, dl_manager) -> dict[str, str]:
    """{name: path} of the release files, downloaded and gunzipped by TFDS."""
    try:
      # Fail fast offline: TFDS would otherwise retry each URL for minutes.
      socket.create_connection(('github.com', 443), timeout=15).close()
      gz = dl_manager.download({name: self.URL.format(name) for name in self.SHA256})
    except Exception as e:  # Any network/SSL/HTTP failure: say what to do offline.
      raise DataError(
          f'Could not download Multi30k ({e}). Offline: put the unzipped files '
          f'{", ".join(self.SHA256)} in a folder and set ${MULTI30K_ENV} or '
          'config.data.manual_dir to it.') from e
    # One file a call: TFDS's extractor deadlocks on more files than its threads (4 a core).
    return {name: os.fspath(dl_manager.extract(path)) for name, path in gz.items()}


def make_builder(config) -> tfds.core.DatasetBuilder:
  """The TFDS builder of config.data.dataset_name (`prepared_builder` prepares it)."""
  data, name = config.data, config.data.dataset_name
  kwargs = {'data_dir': data.data_dir or None}
  if name.startswith('folder:'):
    return ParallelTextFolder(folder=name[len('folder:'):],
                              languages=(data.source_lang, data.target_lang), **kwargs)
  if name == 'multi30k':
    return Multi30k(local_dir=data.manual_dir or os.environ.get(MULTI30K_ENV) or None, **kwargs)
  try:
    return tfds.builder(name, **kwargs)
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


@contextlib.contextmanager
def preparation_lock(builder: tfds.core.DatasetBuilder) -> Iterator[None]:
  """Held while this process prepares `builder`: other processes of this machine that prepare
  it too (two runs started at once on one data_dir) wait, then find it prepared. A data_dir
  on a remote file system (gs://...) has no lock: there only process 0 of a run prepares."""
  data_dir = os.fspath(builder.data_dir)
  if '://' in data_dir:
    yield
    return
  os.makedirs(os.path.dirname(data_dir), exist_ok=True)
  with open(data_dir + '.lock', 'w') as f:  # Beside the version folder, which TFDS ignores.
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepared_builder(config, *, process_index: int = 0) -> tfds.core.DatasetBuilder:
  """The builder of config.data.dataset_name, prepared in its data_dir: process 0 downloads
  and prepares it once (later runs read it), under `preparation_lock`, with TFDS's writer keeping
  PREPARE_BUFFER_BYTES of records in memory; the other processes wait until it is prepared."""
  builder, data = make_builder(config), config.data
  langs = list(builder.info.features.keys())  # Known before (a long) prepare.
  for lang in (data.source_lang, data.target_lang):
    if lang not in langs:
      raise DataError(f'Language {lang!r} not in {data.dataset_name!r} (has {langs}); '
                      'check config.data.source_lang / config.data.target_lang.')
  if builder.is_prepared():
    return builder
  if process_index == 0:
    from tensorflow_datasets.core import shuffle
    with preparation_lock(builder):
      if not builder.is_prepared():  # Else another process prepared it while this one waited.
        logging.info('Preparing %s in %s (once; later runs read it from there).',
                     data.dataset_name, builder.data_dir)
        with mock.patch.object(shuffle, 'MAX_MEM_BUFFER_SIZE', PREPARE_BUFFER_BYTES):
          builder.download_and_prepare(file_format='array_record')
  else:
    wait_for(f'{data.dataset_name} to be prepared in {builder.data_dir}', builder.is_prepared,
             process_index)
  return make_builder(config)  # Reads the prepared copy's info (split sizes).


class PairSource:
  """Random access to a split's (source, target) texts as UTF-8 bytes, read in batches (one
  record at a time costs far more). Holds array_record's data source (file paths and ranges),
  not the builder, so it pickles into Grain's worker processes."""

  def __init__(self, builder: tfds.core.DatasetBuilder, split: str, langs: tuple[str, str]):
    try:
      self._records = builder.as_data_source(
          split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES).data_source
    except NotImplementedError:  # TFRecord files: no random access.
      raise DataError(f'{builder.data_dir} holds {builder.info.full_name} as '
                      f'{builder.info.file_format.value} files, which have no random access: '
                      'delete that folder, or set another config.data.data_dir, to prepare it '
                      'again (as array_record).') from None
    # tfds.testing.mock_data's source reads one record at a time only.
    self._batched = type(self._records).__module__.startswith('array_record')
    self._langs = langs

  def __len__(self) -> int:
    return len(self._records)

  def read(self, indices: Sequence[int]) -> list[tuple[bytes, bytes]]:
    """The (source, target) bytes of the pairs at `indices`."""
    from tensorflow_datasets.proto import tf_example_pb2
    indices = [int(i) for i in indices]
    records = (self._records.__getitems__(indices) if self._batched else
               [self._records[i] for i in indices])
    features = [tf_example_pb2.Example.FromString(r).features.feature for r in records]
    return [tuple(b''.join(f[lang].bytes_list.value) for lang in self._langs) for f in features]


def open_split(config, split: str, *, process_index: int = 0) -> PairSource:
  """The (source, target) pairs of a split (or sub-split such as 'train[:10%]') of
  config.data.dataset_name, prepared first if need be (`prepared_builder`)."""
  data, name = config.data, split.split('[')[0]
  builder = make_builder(config)
  if isinstance(builder, ParallelTextFolder) and name not in builder.splits():
    check_files(builder.folder, name, builder.langs)  # Before preparing: names what is missing.
  builder = prepared_builder(config, process_index=process_index)
  if name not in builder.info.splits:
    raise MissingDataError(f'Split {split!r} not in {data.dataset_name!r}; available: '
                           f'{sorted(builder.info.splits)}.')
  return PairSource(builder, split, (data.source_lang, data.target_lang))
