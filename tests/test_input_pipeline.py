"""Tests for input_pipeline.py and its libraries (nmt/data_sources.py, nmt/train_pipeline.py),
mostly on real Multi30k text ($MULTI30K_DIR or ../shared/data).

Tests that need the Multi30k files are skipped when they are absent.
"""

import codecs
import collections
import gzip
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import input_pipeline as ip
from configs import multi30k
from model import EOS_ID, PAD_ID, UNK_ID
from nmt import batching, config_check, data_sources, legacy, sharding, text_io
from nmt import tokenizer as tokenizer_lib
from nmt import train_pipeline as tp

MULTI30K = Path(os.environ.get(ip.MULTI30K_ENV) or
                Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k')
needs_multi30k = pytest.mark.skipif(
    not (MULTI30K / 'train.en').is_file(),
    reason='needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these machines)')
TRAIN_PAIRS = 400  # The training pipeline's tests read train[:400]: an epoch in a few steps.


def _write(folder: Path, name: str, lines, raw: bytes | None = None) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  data = raw if raw is not None else ''.join(x + '\n' for x in lines).encode('utf-8')
  (folder / name).write_bytes(data)


def _config(tmp: Path, folder: Path):
  config = multi30k.get_config()
  config.data.dataset_name = f'folder:{folder}'
  config.data.data_dir = str(tmp / 'tfds')
  config.data.spm_sample_size = 3000
  config.data.max_length = 32
  config.data.batch_size = 8
  config.data.packing_bins = 4
  config.model.vocab_size = 1000
  return config


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  """(config, tokenizer, (src, tgt)) for the first 2000 Multi30k pairs as a text folder; the
  config trains on the first TRAIN_PAIRS of them, in 4 shards of 2 rows a step."""
  tmp = tmp_path_factory.mktemp('small')
  folder = tmp / 'data'
  for lang in ('en', 'de'):
    _write(folder, f'train.{lang}', text_io.read_lines(MULTI30K / f'train.{lang}')[:2000])
    _write(folder, f'val.{lang}', text_io.read_lines(MULTI30K / f'val.{lang}')[:100])
  config = _config(tmp, folder)
  tokenizer = ip.load_or_train_tokenizer(config, str(tmp / 'work'))
  config.workdir = str(tmp / 'work')
  return config, tokenizer, ip.read_split(config, 'train')


def _unpack(batch):
  """Yields (src_ids, tgt_ids) tuples of a packed batch, checking the row layout."""
  for r in range(batch['inputs'].shape[0]):
    segs = {}
    for side in ('inputs', 'targets'):
      seg, pos, ids = (batch[side + k][r] for k in ('_segmentation', '_positions', ''))
      assert np.all(ids[seg == 0] == PAD_ID) and np.all(pos[seg == 0] == 0)
      n = int((seg > 0).sum())
      assert np.all(seg[n:] == 0), 'padding only at the end of a row'
      assert np.all(np.diff(seg[:n]) >= 0) and (n == 0 or seg[0] == 1)
      for s in np.unique(seg[:n]):
        m = seg == s
        assert np.array_equal(pos[m], np.arange(m.sum())), 'positions restart per segment'
        assert ids[m][-1] == EOS_ID and np.all(ids[m][:-1] != EOS_ID)
        segs.setdefault(int(s), {})[side] = tuple(ids[m].tolist())
    for s in sorted(segs):
      assert set(segs[s]) == {'inputs', 'targets'}, 'segment ids shared by both sides'
      yield segs[s]['inputs'], segs[s]['targets']


def _with_data(config, **data):
  """A copy of config with these config.data settings."""
  config = config.copy_and_resolve_references()
  config.data.update(data)
  return config


def _train(config, **data):
  """config training on train[:TRAIN_PAIRS] (and these config.data settings)."""
  return _with_data(config, train_split=f'train[:{TRAIN_PAIRS}]', **data)


def _iterator(config, process_index=0, process_count=1, state=None):
  it = tp.TrainIterator(ip.open_split(config, config.data.train_split),
                        tp.Settings.of(config, os.path.join(config.workdir, 'tokenizer.model')),
                        process_index, process_count)
  if state is not None:
    it.set_state(state)
  return it


def _global_batches(config, process_count, steps, state=None):
  """`steps` global batches (every process's rows, in process order) and the union of the
  processes' states after them, through JSON."""
  its = [_iterator(config, p, process_count, state) for p in range(process_count)]
  batches = [{k: np.concatenate([b[k] for b in parts]) for k in ip.FEATURE_KEYS}
             for parts in zip(*[[next(it) for _ in range(steps)] for it in its], strict=True)]
  merged = {'num_shards': config.data.num_shards, 'shards': {}}
  for it in its:
    merged['shards'].update(it.get_state()['shards'])
    it.close()
  return batches, json.loads(json.dumps(merged))


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b)
                                  for k in ip.FEATURE_KEYS)


@needs_multi30k
def test_tokenizer_round_trip_without_unk(small):
  _, tokenizer, _ = small
  texts = text_io.read_lines(MULTI30K / 'test_2016_flickr.de')[:200] + [
      'Ein Hund 🐕 läuft über die Straße.', '猫がマットの上に座っている。', 'Ça coûte 5 € — ok?',
      'Zwei  Leerzeichen', '']
  ids = tokenizer.encode(texts)
  assert tokenizer.vocab_size == 1000
  for text, x in zip(texts, ids, strict=True):
    assert x.dtype == np.int32 and x[-1] == EOS_ID
    assert UNK_ID not in x and PAD_ID not in x
    assert tokenizer.decode(x) == text
  padded = np.zeros((2, 40), np.int32)
  padded[0, :len(ids[0])] = ids[0]
  padded[1, :len(ids[-2])] = ids[-2]
  padded[1, len(ids[-2])] = 7  # Anything after EOS is ignored.
  assert [tokenizer.decode(row) for row in padded] == [texts[0], texts[-2]]


def _no_training(*args, **kwargs):
  raise AssertionError('tokenizer retrained or data read')


@needs_multi30k
def test_tokenizer_deterministic_and_reused(small, tmp_path, monkeypatch):
  config, _, _ = small
  a = ip.load_or_train_tokenizer(config, str(tmp_path / 'a'))
  ip.load_or_train_tokenizer(config, str(tmp_path / 'b'))
  bytes_a = (tmp_path / 'a' / 'tokenizer.model').read_bytes()
  assert bytes_a == (tmp_path / 'b' / 'tokenizer.model').read_bytes()
  assert not [f for f in os.listdir(tmp_path / 'a') if 'tmp' in f]
  # The seed drives the sample when the corpus exceeds data.spm_sample_size.
  config2 = config.copy_and_resolve_references()
  config2.seed = config.seed + 1
  ip.load_or_train_tokenizer(config2, str(tmp_path / 'c'))
  assert (tmp_path / 'c' / 'tokenizer.model').read_bytes() != bytes_a
  # An existing model of the configured size is reused: neither data nor trainer is touched.
  monkeypatch.setattr(data_sources, 'prepared_builder', _no_training)
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, 'train', _no_training)
  reused = ip.load_or_train_tokenizer(config2, str(tmp_path / 'a'))
  assert reused.vocab_size == a.vocab_size == config.model.vocab_size
  assert (tmp_path / 'a' / 'tokenizer.model').read_bytes() == bytes_a


@needs_multi30k
def test_target_pieces_first_renumbers_pieces_and_sizes_the_output_layer(small, tmp_path):
  """data.target_pieces_first: the same pieces for every text under new ids, PAD/EOS/UNK
  kept, the training targets' pieces first; the output layer then covers every training
  target with fewer ids than the tokenizer trained without it needs."""
  config, _, (sources, targets) = small
  tokenizers, sizes = {}, {}
  for first in (False, True):
    other = config.copy_and_resolve_references()
    other.data.target_pieces_first = first
    tokenizers[first] = ip.load_or_train_tokenizer(other, str(tmp_path / str(first)))
    sizes[first] = ip.output_vocab_size(other, tokenizers[first])
  plain, ordered = tokenizers[False], tokenizers[True]
  texts = sources[:300] + targets[:300] + ['Ein Hund 🐕 läuft.', '猫がマット']
  new_id = {plain._sp.id_to_piece(i): i for i in range(plain.vocab_size)}
  new_id = {i: ordered._sp.piece_to_id(plain._sp.id_to_piece(i)) for i in new_id.values()}
  for text, a, b in zip(texts, plain.encode(texts), ordered.encode(texts), strict=True):
    assert [new_id[i] for i in a.tolist()] == b.tolist()
    assert ordered.decode(b) == text
  assert sorted(new_id.values()) == list(range(plain.vocab_size))  # A renumbering.
  assert [new_id[i] for i in (PAD_ID, EOS_ID, UNK_ID)] == [PAD_ID, EOS_ID, UNK_ID]
  target_ids = np.unique(np.concatenate(ordered.encode(targets)))
  # First, no gaps (UNK is in no target: the tokenizer falls back to bytes).
  assert target_ids.tolist() == [EOS_ID, *range(UNK_ID + 1, target_ids.max() + 1)]
  assert sizes[True] % ip.OUTPUT_VOCAB_MULTIPLE == 0
  assert target_ids.max() < sizes[True] <= target_ids.max() + ip.OUTPUT_VOCAB_MULTIPLE
  assert sizes[True] < sizes[False] == plain.vocab_size


@needs_multi30k
def test_tokenizer_of_another_vocab_size_is_refused(small, tmp_path, monkeypatch):
  config, tokenizer, _ = small
  path = tmp_path / 'tokenizer.model'
  path.write_bytes(tokenizer._sp.serialized_model_proto())
  monkeypatch.setattr(data_sources, 'prepared_builder', _no_training)
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, 'train', _no_training)
  assert ip.load_or_train_tokenizer(config, str(tmp_path)).vocab_size == 1000
  other = config.copy_and_resolve_references()
  other.model.vocab_size = 600
  with pytest.raises(ip.DataError, match=r'tokenizer\.model has 1000 pieces.*vocab_size is 600'):
    ip.load_or_train_tokenizer(other, str(tmp_path))
  assert path.read_bytes() == tokenizer._sp.serialized_model_proto()  # Left as it was.


@needs_multi30k
def test_only_process_0_trains_the_tokenizer_others_wait(small, tmp_path, monkeypatch, caplog):
  config, tokenizer, _ = small
  monkeypatch.setattr(data_sources, 'WAIT_POLL_SECONDS', 0.01)
  monkeypatch.setattr(data_sources, 'WAIT_LOG_SECONDS', 0.1)
  monkeypatch.setattr(ip, 'tokenizer_sample', _no_training)
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, 'train', _no_training)
  path = tmp_path / 'tokenizer.model'
  # Process 0 writes the model 0.5 s later (atomically, as load_or_train_tokenizer does).
  writer = threading.Timer(0.5, lambda: (
      (tmp_path / 'partial').write_bytes(tokenizer._sp.serialized_model_proto()),
      os.replace(tmp_path / 'partial', path)))
  writer.start()
  with caplog.at_level('INFO'):
    waited = ip.load_or_train_tokenizer(config, str(tmp_path), process_index=1)
  writer.join()
  assert waited.vocab_size == 1000 and 'Process 1 waits for' in caplog.text
  monkeypatch.setattr(data_sources, 'WAIT_TIMEOUT_SECONDS', 0.2)
  with pytest.raises(ip.DataError, match=r'Process 1 waited .* for .*nowhere.tokenizer\.model'):
    ip.load_or_train_tokenizer(config, str(tmp_path / 'nowhere'), process_index=1)


@needs_multi30k
def test_only_process_0_prepares_tfds_data_others_wait(small, tmp_path, monkeypatch):
  config, _, _ = small
  config = _with_data(config, data_dir=str(tmp_path / 'tfds'))
  monkeypatch.setattr(data_sources, 'WAIT_POLL_SECONDS', 0.01)
  preparers = []
  prepare = data_sources.ParallelTextFolder.download_and_prepare
  def recorded_prepare(builder, *args, **kwargs):
    preparers.append(threading.current_thread().name)
    time.sleep(0.5)  # Process 1 asks meanwhile.
    return prepare(builder, *args, **kwargs)
  monkeypatch.setattr(data_sources.ParallelTextFolder, 'download_and_prepare', recorded_prepare)
  process_0 = threading.Thread(target=data_sources.prepared_builder, args=(config,),
                               name='process 0')
  process_0.start()
  time.sleep(0.1)
  src, _ = ip.read_split(config, 'val', process_index=1)
  process_0.join()
  assert preparers == ['process 0'] and len(src) == 100


@needs_multi30k
def test_errors_name_the_file(tmp_path):
  folder = tmp_path / 'bad'
  _write(folder, 'train.en', ['a', 'b', 'c'])
  _write(folder, 'train.de', ['x', 'y'])
  config = _config(tmp_path, folder)
  with pytest.raises(ValueError, match=r'train\.en.*3.*train\.de.*2'):
    ip.read_split(config, 'train')
  with pytest.raises(FileNotFoundError, match=r'test\.en.*test\.de'):
    ip.read_split(config, 'test')
  _write(folder, 'train.de', None, raw='x\nG\xfcnter\n'.encode('latin-1') + b'z\n')
  with pytest.raises(ValueError, match=r'train\.de:2: invalid UTF-8'):
    ip.read_split(config, 'train')
  with pytest.raises(ValueError, match=r'train\.de:2: invalid UTF-8'):
    text_io.read_lines(folder / 'train.de')
  with pytest.raises(FileNotFoundError, match='nowhere'):
    ip.read_split(_config(tmp_path, tmp_path / 'nowhere'), 'train')
  config.data.dataset_name = 'no_such_dataset_xyz/de-en'
  with pytest.raises(ip.DataError, match='no_such_dataset_xyz'):
    ip.read_split(config, 'train')


@needs_multi30k
def test_empty_lines_skipped_for_train_kept_for_eval(tmp_path):
  folder = tmp_path / 'data'
  _write(folder, 'train.en', ['a dog', '', 'a cat', 'a bird'])
  _write(folder, 'train.de', ['ein Hund', 'leer', 'eine Katze', ' '])
  _write(folder, 'val.en', ['a', ''])
  _write(folder, 'val.de', ['b', 'c'])
  config = _config(tmp_path, folder)
  assert ip.read_split(config, 'train') == (['a dog', 'a cat'], ['ein Hund', 'eine Katze'])
  assert ip.read_split(config, 'val') == (['a', ''], ['b', 'c'])



def test_a_run_waits_for_another_process_preparing_the_same_data(tmp_path):
  """Two runs started at once on one data_dir (or two test workers): the second waits for the
  first's preparation, then reads it, instead of failing to rename its own copy into place."""
  import fcntl
  folder = tmp_path / 'data'
  _write(folder, 'train.en', ['a dog', 'a cat'])
  _write(folder, 'train.de', ['ein Hund', 'eine Katze'])
  config = _config(tmp_path, folder)
  builder = data_sources.make_builder(config)
  read = []
  with data_sources.preparation_lock(builder):  # Another process is preparing it.
    waiting = threading.Thread(target=lambda: read.append(ip.read_split(config, 'train')))
    waiting.start()
    waiting.join(3)
    assert waiting.is_alive() and not builder.is_prepared()
    builder.download_and_prepare(file_format='array_record')
  waiting.join(120)
  assert read == [(['a dog', 'a cat'], ['ein Hund', 'eine Katze'])]
  with open(os.fspath(builder.data_dir) + '.lock', 'w') as f:  # Released.
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

def _no_network(*args, **kwargs):
  raise AssertionError('network used')


@needs_multi30k
def test_multi30k_builder_local_copy(tmp_path, monkeypatch):
  monkeypatch.setenv(ip.MULTI30K_ENV, str(MULTI30K))
  monkeypatch.setattr(data_sources.socket, 'create_connection', _no_network)
  monkeypatch.setattr(data_sources.tfds.download.DownloadManager, 'download', _no_network)
  config = multi30k.get_config()
  config.data.data_dir = str(tmp_path / 'tfds')
  sizes = {'train': 29000, 'val': 1014, 'test_2016_flickr': 1000}
  for split, n in sizes.items():
    src, tgt = ip.read_split(config, split)
    assert len(src) == len(tgt) == n
    assert src == [x.strip() for x in text_io.read_lines(MULTI30K / f'{split}.en')]
    assert tgt == [x.strip() for x in text_io.read_lines(MULTI30K / f'{split}.de')]
  config.data.target_lang = 'fr'
  assert ip.read_split(config, 'val')[1][0] == text_io.read_lines(MULTI30K / 'val.fr')[0].strip()
  # A local copy lacking files: the error lists what to put where.
  config.data.data_dir = str(tmp_path / 'tfds2')
  config.data.manual_dir = str(tmp_path / 'empty')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match=r'empty.*train\.en.*test_2016_flickr\.fr'):
    ip.read_split(config, 'train')


@needs_multi30k
def test_multi30k_download_is_gunzipped_and_checked(tmp_path, monkeypatch):
  """Download path with the network faked by local .gz files (checksums of the content)."""
  gz_dir = tmp_path / 'gz'
  gz_dir.mkdir()
  for name in data_sources.Multi30k.SHA256:
    with gzip.open(gz_dir / f'{name}.gz', 'wb') as f:
      f.write((MULTI30K / name).read_bytes())
  monkeypatch.delenv(ip.MULTI30K_ENV, raising=False)
  monkeypatch.setattr(data_sources.socket, 'create_connection', lambda *a, **k: io.BytesIO())
  fake = lambda self, urls: {k: gz_dir / v.rsplit('/', 1)[1] for k, v in urls.items()}
  monkeypatch.setattr(data_sources.tfds.download.DownloadManager, 'download', fake)
  config = multi30k.get_config()
  config.data.data_dir = str(tmp_path / 'tfds')
  assert ip.read_split(config, 'val')[0][:2] == text_io.read_lines(MULTI30K / 'val.en')[:2]
  # A corrupted download is refused.
  with gzip.open(gz_dir / 'val.de.gz', 'wb') as f:
    f.write(b'Falsch\n' * 1014)
  config.data.data_dir = str(tmp_path / 'tfds2')
  with pytest.raises(ip.DataError, match=r'val\.de: sha256 mismatch'):
    ip.read_split(config, 'val')


@needs_multi30k
def test_multi30k_recipe_vocabulary_and_packing_efficiency(tmp_path, monkeypatch):
  """The default recipe: its 10k BPE trains fast and packing at max_length 64 is >= 90%."""
  monkeypatch.setenv(ip.MULTI30K_ENV, str(MULTI30K))
  config = multi30k.get_config()
  config.data.data_dir = str(tmp_path / 'tfds')
  data = ip.make_data(config, str(tmp_path / 'work'))
  assert data.tokenizer.vocab_size == config.model.vocab_size == 10000
  batches = [next(data.train) for _ in range(20)]
  data.train.close()
  assert batches[0]['inputs'].shape == (32, 64)
  real = sum(int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum()) for b in batches)
  assert real / (20 * 2 * 32 * 64) >= 0.90


def test_read_lines_from_stdin(monkeypatch):
  class Stdin:
    def __init__(self, data: bytes):
      self.buffer = io.BytesIO(data)

  monkeypatch.setattr(sys, 'stdin', Stdin('a dog\r\n\nüber 🐕\nno newline'.encode()))
  assert text_io.read_lines('-') == ['a dog', '', 'über 🐕', 'no newline']
  monkeypatch.setattr(sys, 'stdin', Stdin(b'one\n'))
  assert text_io.read_lines('-') == ['one']  # A final newline ends the last line, adds none.
  monkeypatch.setattr(sys, 'stdin', Stdin(b''))
  assert text_io.read_lines('-') == []
  monkeypatch.setattr(sys, 'stdin', Stdin('x\nG\xfcnter\n'.encode('latin-1')))
  with pytest.raises(ip.DataError, match=r'stdin:2: invalid UTF-8'):
    text_io.read_lines('-')


def test_read_lines_drops_a_byte_order_mark_and_reads_pipes(tmp_path):
  """A BOM (Windows editors write one) used to stay in the first line and change its
  translation; a pipe or process substitution (/dev/fd/N) was 'file not found'."""
  path = tmp_path / 'bom.txt'
  path.write_bytes(codecs.BOM_UTF8 + 'A dog.\n\ufeffkept\n'.encode())
  assert text_io.read_lines(path) == ['A dog.', '\ufeffkept']  # Only the file's first character.
  read_end, write_end = os.pipe()
  os.write(write_end, codecs.BOM_UTF8 + b'one\ntwo\n')
  os.close(write_end)
  try:
    assert text_io.read_lines(f'/dev/fd/{read_end}') == ['one', 'two']
  finally:
    os.close(read_end)
  read_end, write_end = os.pipe()
  os.write(write_end, codecs.BOM_UTF8 + b'streamed\n')
  os.close(write_end)
  try:
    assert list(text_io.stream_lines(read_end)) == [['streamed']]
  finally:
    os.close(read_end)
  with pytest.raises(ip.MissingDataError, match='is a folder'):
    text_io.read_lines(tmp_path)
  with pytest.raises(ip.MissingDataError, match='file not found'):
    text_io.read_lines(tmp_path / 'missing.txt')


def _seq(rng, n: int) -> np.ndarray:
  """n - 1 random non-special ids and EOS."""
  return np.append(rng.integers(3, 100, size=n - 1), EOS_ID).astype(np.int32)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@pytest.mark.parametrize('row_multiple', [1, 4])
def test_length_batches_cover_every_pair_within_budget(row_multiple):
  budget, max_length = 256, 40
  rng = np.random.default_rng(row_multiple)
  # Independent lengths per side: a row's length is set by the longer side of its pair.
  sides = {'inputs': [_seq(rng, n) for n in rng.integers(1, 61, size=300)],
           'targets': [_seq(rng, n) for n in rng.integers(1, 61, size=300)]}
  sides['inputs'].append(_seq(rng, 300))  # Longer than the budget and than max_length.
  sides['targets'].append(_seq(rng, 3))
  sides['inputs'].append(_seq(rng, 2))  # Only the target side is too long.
  sides['targets'].append(_seq(rng, 50))
  originals = {k: [x.copy() for x in v] for k, v in sides.items()}
  count = len(sides['inputs'])

  def expected(side, i, limit):
    x = originals[side][i]
    return x if limit is None or len(x) <= limit else np.append(x[:limit - 1], EOS_ID)

  for limit in (None, max_length):
    batches = batching.length_batches(sides, budget, max_length=limit, row_multiple=row_multiple)
    seen = np.concatenate([idx for idx, _ in batches])
    assert seen.dtype == np.int64 and sorted(seen.tolist()) == list(range(count))
    lone_oversize, previous_length = 0, 0
    for idx, arrays in batches:
      assert set(arrays) == {'inputs', 'targets'}
      rows, length = arrays['inputs'].shape
      assert arrays['targets'].shape == (rows, length)
      assert all(a.dtype == np.int32 for a in arrays.values())
      # Rows: the smallest power of two >= the batch that row_multiple divides.
      assert rows & (rows - 1) == 0 and rows % row_multiple == 0
      assert rows >= len(idx) and (rows == row_multiple or rows < 2 * len(idx))
      # Length: the longest side of any member, rounded up to 8; sorted by it.
      wanted = [expected(side, i, limit) for side in sides for i in idx]
      assert length == _round_up(max(len(x) for x in wanted), 8)
      assert length >= previous_length
      previous_length = length
      # The budget holds for the padded batch; only a lone member may break it.
      if rows * length > budget:
        assert len(idx) == 1 and rows == row_multiple
        lone_oversize += length > budget
      # Both sides of a pair in the same row, PAD after them and in the padding rows.
      for side, ids in arrays.items():
        for r, i in enumerate(idx):
          x = expected(side, i, limit)
          assert np.array_equal(ids[r, :len(x)], x) and np.all(ids[r, len(x):] == PAD_ID)
        assert np.all(ids[len(idx):] == PAD_ID)
      if limit is not None:
        assert length <= _round_up(limit, 8)
        lengths = (arrays['inputs'][:len(idx)] != PAD_ID).sum(1)
        assert np.all(lengths <= limit)
    # Untruncated, the 300-token source is too long for any batch of 256 tokens.
    assert lone_oversize == (1 if limit is None else 0)
  # Truncation ends in EOS and happens on copies: the caller's sequences are unchanged.
  assert all(np.array_equal(a, b) for side in sides
             for a, b in zip(sides[side], originals[side], strict=True))
  truncated = batching.length_batches(sides, budget, max_length=max_length)
  for idx, arrays in truncated:
    for r, i in enumerate(idx):
      if i == count - 2:
        assert arrays['inputs'][r, max_length - 1] == EOS_ID
        assert np.array_equal(arrays['inputs'][r, :max_length - 1],
                              originals['inputs'][i][:max_length - 1])


def test_length_batches_single_side_and_length_multiple():
  rng = np.random.default_rng(0)
  seqs = [_seq(rng, n) for n in (5, 17, 3, 16, 9)]
  batches = batching.length_batches({'inputs': seqs}, max_batch_tokens=64, length_multiple=16)
  # Within a padded length, shortest first (lengths 3, 5, 9, 16).
  assert [(idx.tolist(), a['inputs'].shape) for idx, a in batches] == [
      ([2, 0, 4, 3], (4, 16)), ([1], (1, 32))]


@needs_multi30k
def test_multi30k_local_copy_is_prepared_again_when_its_files_change(tmp_path, monkeypatch):
  """Before: once prepared, the TFDS cache was read whatever MULTI30K_DIR then held."""
  local = tmp_path / 'multi30k'
  local.mkdir()
  for name in data_sources.Multi30k.SHA256:
    (local / name).write_bytes((MULTI30K / name).read_bytes())
  monkeypatch.setenv(ip.MULTI30K_ENV, str(local))
  config = multi30k.get_config()
  config.data.data_dir = str(tmp_path / 'tfds')
  assert ip.read_split(config, 'val')[1][0] == text_io.read_lines(MULTI30K / 'val.de')[0].strip()
  lines = text_io.read_lines(local / 'val.de')
  (local / 'val.de').write_text('\n'.join(['Ein geänderter Satz.'] + lines[1:]) + '\n',
                                encoding='utf-8')
  assert ip.read_split(config, 'val')[1][:2] == ['Ein geänderter Satz.', lines[1].strip()]
  # An emptied folder is an error naming the missing files, not the old cache.
  for name in data_sources.Multi30k.SHA256:
    (local / name).unlink()
  with pytest.raises(FileNotFoundError, match=r'lacks.*train\.en'):
    ip.read_split(config, 'val')


TATOEBA = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'tatoeba_deu_small'


@pytest.mark.skipif(not (TATOEBA / 'train.de').is_file(),
                    reason=f'Tatoeba test data not found at {TATOEBA}')
def test_tatoeba_config_reads_its_folder_german_to_english(tmp_path):
  from configs import tatoeba_de_en
  config = tatoeba_de_en.get_config()
  config.data.dataset_name = f'folder:{TATOEBA}'
  config.data.data_dir = str(tmp_path / 'tfds')
  for split, count in ((config.data.eval_split, 878), (config.data.test_split, 901)):
    sources, targets = ip.read_split(config, split)
    lines = lambda lang: (TATOEBA / f'{split}.{lang}').read_text(encoding='utf-8').splitlines()
    assert len(sources) == count and sources == [x.strip() for x in lines('de')]
    assert targets == [x.strip() for x in lines('en')]


@needs_multi30k
def test_every_pair_once_per_shard_epoch_and_epochs_reshuffled(small):
  """Shard 1 of 4 holds pairs 1, 5, 9, ... of train[:400]; each epoch yields them all once
  (less the pairs over max_length), in a new order."""
  config, tokenizer, (src, tgt) = small
  config = _train(config)
  source = ip.open_split(config, config.data.train_split)
  settings = tp.Settings.of(config, os.path.join(config.workdir, 'tokenizer.model'))
  expected = collections.Counter(
      (tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(
          tokenizer.encode(src[1:TRAIN_PAIRS:4]), tokenizer.encode(tgt[1:TRAIN_PAIRS:4]))
      if max(len(a), len(b)) <= config.data.max_length)
  assert 50 < sum(expected.values()) < 100, 'max_length=32 drops some pairs'
  pairs = iter(tp.pair_dataset(source, 1, settings))
  epochs = [[next(pairs) for _ in range(sum(expected.values()))] for _ in range(2)]
  orders = [[(tuple(p['inputs'].tolist()), tuple(p['targets'].tolist())) for p in epoch]
            for epoch in epochs]
  assert all(p['inputs'].dtype == np.int32 for p in epochs[0])
  assert collections.Counter(orders[0]) == collections.Counter(orders[1]) == expected
  assert orders[0] != orders[1]


@needs_multi30k
def test_packed_batches_hold_the_shards_pairs_in_rows(small):
  config, tokenizer, (src, tgt) = small
  config = _train(config)
  batches, state = _global_batches(config, 1, 30)
  assert all(v.shape == (8, 32) and v.dtype == np.int32 for v in batches[0].values())
  assert set(batches[0]) == set(ip.FEATURE_KEYS)
  encoded = set(zip((tuple(x.tolist()) for x in tokenizer.encode(src[:TRAIN_PAIRS])),
                    (tuple(x.tolist()) for x in tokenizer.encode(tgt[:TRAIN_PAIRS]))))
  for b in batches:
    for s in range(4):  # Rows 2 s, 2 s + 1: shard s's pairs s, s + 4, ...
      for pair in _unpack({k: v[2 * s:2 * s + 2] for k, v in b.items()}):
        assert pair in encoded
  real = sum(int((b['inputs_segmentation'] > 0).sum() + (b['targets_segmentation'] > 0).sum())
             for b in batches)
  assert real / (30 * 2 * 8 * 32) > 0.6  # Packing efficiency (pairs of 10-32 tokens a side).
  assert sorted(state['shards']) == ['0', '1', '2', '3'] and state['num_shards'] == 4


@needs_multi30k
def test_global_batches_do_not_depend_on_process_count(small):
  """1, 2 and 4 processes give the same global batches (across a shard's epoch boundary, 100
  pairs a shard), and the union of their states resumes on any of them."""
  config = _train(small[0])
  steps = 40
  one, state_one = _global_batches(config, 1, steps)
  for process_count in (2, 4):
    batches, state = _global_batches(config, process_count, steps)
    assert _same(batches, one), process_count
    assert state == state_one
  _, state = _global_batches(config, 4, 17)
  for process_count in (1, 2):
    assert _same(_global_batches(config, process_count, 5, state)[0], one[17:22])


@needs_multi30k
@pytest.mark.parametrize('dropout', [{}, {'bpe_dropout': 0.1, 'source_token_dropout': 0.1}])
def test_resume_equals_uninterrupted_run(small, dropout):
  """A state saved after k batches (through JSON) continues with the uninterrupted batches,
  across a shard's epoch end; with BPE-dropout and source token dropout too, drawn anew per
  chunk."""
  config = _train(small[0], **dropout)
  uninterrupted, _ = _global_batches(config, 1, 45)
  for k in (1, 13, 30):
    first, state = _global_batches(config, 1, k)
    assert _same(first, uninterrupted[:k])
    assert _same(_global_batches(config, 1, 45 - k, state)[0], uninterrupted[k:]), k
  it = _iterator(config)
  with pytest.raises(ip.DataError, match=r'no position for shards \[2, 3\]'):
    it.set_state({'num_shards': 4, 'shards': {'0': {}, '1': {}}})
  it.close()


@needs_multi30k
def test_deterministic_under_seed(small):
  config = _train(small[0])
  a, _ = _global_batches(config, 1, 4)
  assert _same(_global_batches(config, 1, 4)[0], a)
  other = config.copy_and_resolve_references()
  other.seed = config.seed + 1
  assert not _same(_global_batches(other, 1, 4)[0], a)


@needs_multi30k
def test_bpe_dropout_changes_training_pieces_only(small, tmp_path):
  """With p = 0 the Python BPE gives sentencepiece's ids; with p > 0 training pieces change
  (and still spell the text), while evaluation batches and decoding's encode do not."""
  config, tokenizer, (src, tgt) = small
  config = _train(config)
  lines = src[:300] + tgt[:300] + ['', 'Ein Hund 🐕 läuft über die Straße.', '猫が座っている。',
                                   '  two  spaces ', 'Ça coûte 5 €']
  rng = np.random.default_rng(0)
  assert all(np.array_equal(a, b) for a, b in zip(
      tokenizer.encode(lines, dropout=1e-12, rng=rng), tokenizer.encode(lines), strict=True))
  dropped = tokenizer.encode(lines, dropout=0.1, rng=np.random.default_rng(0))
  assert [tokenizer.decode(x) for x in dropped] == lines
  assert sum(len(x) for x in dropped) > 1.1 * sum(len(x) for x in tokenizer.encode(lines))
  assert all(np.array_equal(a, b) for a, b in zip(
      dropped, tokenizer.encode(lines, dropout=0.1, rng=np.random.default_rng(0))))
  plain, with_dropout = (
      ip.make_data(_with_data(config, bpe_dropout=p), config.workdir) for p in (0.0, 0.1))
  assert not _same([next(plain.train) for _ in range(3)], [next(with_dropout.train)
                                                           for _ in range(3)])
  assert len(plain.eval_batches) == len(with_dropout.eval_batches)
  for a, b in zip(plain.eval_batches, with_dropout.eval_batches, strict=True):
    assert all(np.array_equal(a[k], b[k]) for k in ('inputs', 'targets'))
  plain.train.close()
  with_dropout.train.close()


def test_drop_tokens_replaces_pieces_by_unk_at_its_rate_and_keeps_the_end():
  rng = np.random.default_rng(1)
  ids = np.append(rng.integers(3, 1000, 20_000), EOS_ID).astype(np.int32)
  dropped = tp.drop_tokens(ids, 0.2, np.random.default_rng(2))
  assert dropped.dtype == np.int32 and dropped.shape == ids.shape and dropped[-1] == EOS_ID
  replaced = dropped != ids
  assert np.all(dropped[replaced] == UNK_ID)
  assert 0.19 < replaced.mean() < 0.21
  assert np.array_equal(dropped, tp.drop_tokens(ids, 0.2, np.random.default_rng(2)))
  assert np.array_equal(tp.drop_tokens(ids[-1:], 0.9, rng), ids[-1:])  # An empty source.


@needs_multi30k
def test_source_token_dropout_changes_training_sources_only(small):
  """The same pairs in the same rows: only source pieces become UNK, about at the rate;
  targets, positions and the evaluation batches stay as they are."""
  config = _train(small[0])
  plain, dropped = (_global_batches(_with_data(config, source_token_dropout=p), 1, 6)[0]
                    for p in (0.0, 0.25))
  for a, b in zip(plain, dropped, strict=True):
    for key in ip.FEATURE_KEYS:
      if key != 'inputs':
        np.testing.assert_array_equal(a[key], b[key])
    changed = a['inputs'] != b['inputs']
    assert np.all(b['inputs'][changed] == UNK_ID) and not np.any(a['inputs'][changed] == EOS_ID)
  pieces = sum(int(((a['inputs'] > EOS_ID)).sum()) for a in plain)
  unk = sum(int((b['inputs'] == UNK_ID).sum() - (a['inputs'] == UNK_ID).sum())
            for a, b in zip(plain, dropped))
  assert 0.2 < unk / pieces < 0.3, unk / pieces
  eval_plain, eval_dropped = (ip.make_data(_with_data(config, source_token_dropout=p),
                                           config.workdir) for p in (0.0, 0.25))
  for a, b in zip(eval_plain.eval_batches, eval_dropped.eval_batches, strict=True):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  eval_plain.train.close()
  eval_dropped.train.close()
  older = config.copy_and_resolve_references()  # A config written before the setting.
  del older.data['source_token_dropout']
  assert tp.Settings.of(older, 'tokenizer.model').source_token_dropout == 0.0


@needs_multi30k
@pytest.mark.slow  # Grain's worker processes are spawned: each imports JAX.
def test_worker_processes_give_the_in_process_batches(small):
  config = _train(small[0], bpe_dropout=0.1)
  expected, state = _global_batches(config, 1, 12)
  workers = _with_data(config, num_workers=2)
  assert _same(_global_batches(workers, 2, 12)[0], expected)
  _, state = _global_batches(workers, 1, 5)
  assert _same(_global_batches(config, 1, 7, state)[0], expected[5:])


@needs_multi30k
def test_make_data_resumes_from_a_checkpoints_state_and_warns_on_old_ones(small, caplog):
  config = _train(small[0])
  uninterrupted, _ = _global_batches(config, 1, 8)
  data = ip.make_data(config, config.workdir)
  assert _same([next(data.train) for _ in range(6)], uninterrupted[:6])
  state = json.loads(json.dumps(data.train.get_state()))
  data.train.close()
  resumed = ip.make_data(config, config.workdir, data_state=state)
  assert _same([next(resumed.train) for _ in range(2)], uninterrupted[6:])
  resumed.train.close()
  for old in ({'epoch': 2, 'batch_in_epoch': 7},  # Of the earlier pipeline.
              {'num_streams': 4, 'positions': [[0, 4]] * 4},
              {'num_shards': 2, 'shards': {'0': {}, '1': {}}}):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert legacy.upgrade_data_state(old, 4) is None
      fresh = ip.make_data(config, config.workdir, data_state=old)
    assert 'starts a fresh epoch' in caplog.text
    assert _same([next(fresh.train)], uninterrupted[:1])
    fresh.train.close()


@needs_multi30k
def test_evaluation_batches_hold_every_validation_pair_once(small):
  config, tokenizer, _ = small
  data = ip.make_data(config, config.workdir, row_multiple=4)
  data.train.close()
  assert len(data.eval_sources) == len(data.eval_targets) == 100
  pairs = collections.Counter()
  for batch in data.eval_batches:
    assert batch['inputs'].shape[0] % 4 == 0
    for s, t in zip(batch['inputs'], batch['targets']):
      if s.any():
        pairs[(tuple(s[s > 0].tolist()), tuple(t[t > 0].tolist()))] += 1
  assert pairs == collections.Counter(
      (tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(
          tokenizer.encode(data.eval_sources), tokenizer.encode(data.eval_targets)))


def test_shards_must_divide_the_batch_and_the_processes(monkeypatch):
  config = multi30k.get_config()
  mesh = sharding.make_mesh('', jax.devices()[:1])
  config.data.num_shards = 3
  with pytest.raises(config_check.ConfigError, match=r'batch_size=32 .*num_shards=3.*divisor'):
    config_check.validate_config(config, mesh)
  config.data.num_shards = 4
  monkeypatch.setattr(config_check.jax, 'process_count', lambda: 8)
  with pytest.raises(config_check.ConfigError, match=r'num_shards=4 .* 8 processes.*multiple'):
    config_check.validate_config(config, mesh)
  monkeypatch.undo()
  config.data.bpe_dropout = 1.0
  with pytest.raises(config_check.ConfigError, match=r'bpe_dropout in \[0, 1\)'):
    config_check.validate_config(config, mesh)
  config.data.bpe_dropout = 0.0
  config.data.source_token_dropout = -0.1
  with pytest.raises(config_check.ConfigError, match=r'source_token_dropout must be in \[0, 1\)'):
    config_check.validate_config(config, mesh)


@needs_multi30k
def test_malformed_training_pairs_are_counted_dropped_and_logged(tmp_path, small, caplog):
  """Empty sides and over-long pairs: dropped in the pipeline with a warning, never an error."""
  config = small[0]
  folder = tmp_path / 'data'
  _write(folder, 'train.en', ['a man', '', 'dogs run', ' '] * 50 + ['word ' * 80])
  _write(folder, 'train.de', ['ein Mann', 'Hunde', '', 'x'] * 50 + ['Wort'])
  bad = _with_data(config, dataset_name=f'folder:{folder}', data_dir=str(tmp_path / 'tfds'),
                   train_split='train', num_shards=1)
  with caplog.at_level(logging.INFO):
    it = _iterator(bad)
    pairs = [p for _ in range(20) for p in _unpack(next(it))]
    it.close()
  assert {len(s) for s, _ in pairs} and all(len(s) <= 32 for s, _ in pairs)
  assert 'dropped' in caplog.text and 'an empty side' in caplog.text
  assert 'longer than data.max_length' in caplog.text


@needs_multi30k
def test_splits_are_read_without_tensorflow_in_file_order(small):
  """read_split reads the prepared array_record files by index: file order, no TensorFlow."""
  config, _, (src, tgt) = small
  lines = {lang: text_io.read_lines(MULTI30K / f'train.{lang}')[:2000] for lang in ('en', 'de')}
  assert (src, tgt) == ([x.strip() for x in lines['en']], [x.strip() for x in lines['de']])
  builder = data_sources.prepared_builder(config)
  assert builder.info.file_format.value == 'array_record'
  script = ('import sys, json, input_pipeline as ip\n'
            'from configs import multi30k\n'
            'config = multi30k.get_config()\n'
            'config.data.update(json.loads(sys.argv[1]))\n'
            'src, tgt = ip.read_split(config, "val")\n'
            'assert "tensorflow" not in sys.modules, "read_split imported TensorFlow"\n'
            'print(len(src))\n')
  data = json.dumps({'dataset_name': config.data.dataset_name,
                     'data_dir': config.data.data_dir})
  result = subprocess.run([sys.executable, '-c', script, data], capture_output=True,
                          cwd=str(Path(__file__).resolve().parents[1]), timeout=300)
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  assert result.stdout.decode().split() == ['100']


@needs_multi30k
def test_folder_preparation_streams_with_a_bounded_buffer(tmp_path, monkeypatch):
  """The text files are read line by line (keys increasing, spread over TFDS's key space) and
  TFDS keeps PREPARE_BUFFER_BYTES of records in memory before spilling to disk."""
  folder = tmp_path / 'data'
  _write(folder, 'train.en', ['one', 'two', 'three'])
  _write(folder, 'train.de', ['eins', 'zwei', 'drei'])
  paths = data_sources.check_files(str(folder), 'train', ('en', 'de'))
  keys = [key for key, _ in data_sources.stream_pairs(paths)]
  assert keys == sorted(keys) and keys[-1] > 2**126
  from tensorflow_datasets.core import shuffle
  buffers = []
  prepare = data_sources.ParallelTextFolder.download_and_prepare
  def recorded_prepare(builder, *args, **kwargs):
    buffers.append(shuffle.MAX_MEM_BUFFER_SIZE)
    return prepare(builder, *args, **kwargs)
  monkeypatch.setattr(data_sources.ParallelTextFolder, 'download_and_prepare', recorded_prepare)
  config = _config(tmp_path, folder)
  assert ip.read_split(config, 'train') == (['one', 'two', 'three'], ['eins', 'zwei', 'drei'])
  assert buffers == [data_sources.PREPARE_BUFFER_BYTES] != [shuffle.MAX_MEM_BUFFER_SIZE]
