"""Tests for input_pipeline.py, mostly on real Multi30k text ($MULTI30K_DIR or ../shared/data).

Tests that need the Multi30k files are skipped when they are absent.
"""

import codecs
import collections
import dataclasses
import gzip
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import input_pipeline as ip
from configs import multi30k
from model import EOS_ID, PAD_ID, UNK_ID
from nmt import batching, text_io
from nmt import tokenizer as tokenizer_lib

MULTI30K = Path(os.environ.get(ip.MULTI30K_ENV) or
                Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k')
needs_multi30k = pytest.mark.skipif(not (MULTI30K / 'train.en').is_file(),
                                    reason=f'Multi30k test data not found at {MULTI30K}')


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
  config.data.shuffle_buffer = 1024
  config.model.vocab_size = 1000
  return config


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  """(config, tokenizer, (src, tgt)) for the first 2000 Multi30k pairs as a text folder."""
  tmp = tmp_path_factory.mktemp('small')
  folder = tmp / 'data'
  for lang in ('en', 'de'):
    _write(folder, f'train.{lang}', text_io.read_lines(MULTI30K / f'train.{lang}')[:2000])
    _write(folder, f'val.{lang}', text_io.read_lines(MULTI30K / f'val.{lang}')[:100])
  config = _config(tmp, folder)
  tokenizer = ip.load_or_train_tokenizer(config, str(tmp / 'work'))
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


def _expected_pairs(config, tokenizer, src, tgt):
  s, t = tokenizer.encode(src), tokenizer.encode(tgt)
  return collections.Counter(
      (tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(s, t, strict=True)
      if len(a) <= config.data.max_length and len(b) <= config.data.max_length)


def _with_data(config, **data):
  """A copy of config with these config.data settings."""
  config = config.copy_and_resolve_references()
  config.data.update(data)
  return config


def _global_batches(config, tokenizer, process_count, steps, state=None):
  """`steps` global batches: every process's slice, concatenated in process order."""
  its = [ip.make_train_iterator(config, tokenizer, process_index=p, process_count=process_count,
                                state=state) for p in range(process_count)]
  batches = [{k: np.concatenate([b[k] for b in parts]) for k in ip.FEATURE_KEYS}
             for parts in zip(*[[next(it) for _ in range(steps)] for it in its], strict=True)]
  return batches, its


def _same(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in ip.FEATURE_KEYS)


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
  monkeypatch.setattr(ip, 'prepared_builder', _no_training)
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, 'train', _no_training)
  reused = ip.load_or_train_tokenizer(config2, str(tmp_path / 'a'))
  assert reused.vocab_size == a.vocab_size == config.model.vocab_size
  assert (tmp_path / 'a' / 'tokenizer.model').read_bytes() == bytes_a


@needs_multi30k
def test_tokenizer_of_another_vocab_size_is_refused(small, tmp_path, monkeypatch):
  config, tokenizer, _ = small
  path = tmp_path / 'tokenizer.model'
  path.write_bytes(tokenizer._sp.serialized_model_proto())
  monkeypatch.setattr(ip, 'prepared_builder', _no_training)
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
  monkeypatch.setattr(ip, 'WAIT_POLL_SECONDS', 0.01)
  monkeypatch.setattr(ip, 'WAIT_LOG_SECONDS', 0.1)
  monkeypatch.setattr(ip, 'tokenizer_sample', _no_training)
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, 'train', _no_training)
  path = tmp_path / 'tokenizer.model'
  # Process 0 writes the model 0.5 s later (atomically, as load_or_train_tokenizer does).
  writer = threading.Timer(0.5, lambda: (
      (tmp_path / 'partial').write_bytes(tokenizer._sp.serialized_model_proto()),
      os.replace(tmp_path / 'partial', path)))
  writer.start()
  with caplog.at_level('INFO'):
    waited = ip.load_or_train_tokenizer(config, str(tmp_path), process_index=1, process_count=2)
  writer.join()
  assert waited.vocab_size == 1000 and 'Process 1 waits for' in caplog.text
  monkeypatch.setattr(ip, 'WAIT_TIMEOUT_SECONDS', 0.2)
  with pytest.raises(ip.DataError, match=r'Process 1 waited .* for .*nowhere.tokenizer\.model'):
    ip.load_or_train_tokenizer(config, str(tmp_path / 'nowhere'), process_index=1,
                               process_count=2)


@needs_multi30k
def test_only_process_0_prepares_tfds_data_others_wait(small, tmp_path, monkeypatch):
  config, _, _ = small
  config = _with_data(config, data_dir=str(tmp_path / 'tfds'))
  monkeypatch.setattr(ip, 'WAIT_POLL_SECONDS', 0.01)
  preparers = []
  prepare = ip.ParallelTextFolder.download_and_prepare
  def recorded_prepare(builder, *args, **kwargs):
    preparers.append(threading.current_thread().name)
    time.sleep(0.5)  # Process 1 asks meanwhile.
    return prepare(builder, *args, **kwargs)
  monkeypatch.setattr(ip.ParallelTextFolder, 'download_and_prepare', recorded_prepare)
  process_0 = threading.Thread(target=ip.prepared_builder, args=(config,), name='process 0')
  process_0.start()
  time.sleep(0.1)
  src, _ = ip.read_split(config, 'val', process_index=1, process_count=2)
  process_0.join()
  assert preparers == ['process 0'] and len(src) == 100


def _reference_best_fit(src_lens, tgt_lens, order, max_length):
  """Best-fit decreasing one pair at a time over a plain list of open rows."""
  order = sorted(order, key=lambda p: (-(src_lens[p] + tgt_lens[p]), -src_lens[p]))
  rows, room, placed_at = [], [], []
  for step, p in enumerate(order):
    a, b = int(src_lens[p]), int(tgt_lens[p])
    fits = [r for r, (rs, rt) in enumerate(room) if rs >= a and rt >= b]
    if not fits:
      rows.append([p])
      room.append((max_length - a, max_length - b))
      placed_at.append(step)
      continue
    r = min(fits, key=lambda r: (sum(room[r]), room[r][0], -placed_at[r]))
    rows[r].append(p)
    room[r] = (room[r][0] - a, room[r][1] - b)
    placed_at[r] = step
  return rows


def test_pack_rows_equals_pair_by_pair_best_fit():
  for trial in range(20):
    rng = np.random.default_rng(trial)
    max_length = int(rng.choice([6, 16, 32]))
    src = rng.integers(1, max_length + 1, 500)
    tgt = np.clip(src + rng.integers(-3, 4, 500), 1, max_length)
    if trial % 3 == 0:  # Few distinct lengths: long runs of equal pairs placed in bulk.
      src, tgt = rng.integers(1, 4, 500), rng.integers(1, 4, 500)
    order = rng.permutation(500)[:rng.integers(1, 400)]
    pair_order, row_offsets = ip.pack_rows(src, tgt, order, max_length)
    rows = [pair_order[row_offsets[r]:row_offsets[r + 1]].tolist()
            for r in range(len(row_offsets) - 1)]
    assert rows == _reference_best_fit(src, tgt, order, max_length)


def _stream_pairs(batches, stream, rows_per_step, count):
  """Pairs of a stream's rows in the first `count` global batches."""
  rows = slice(stream * rows_per_step, (stream + 1) * rows_per_step)
  return collections.Counter(p for b in batches[:count]
                             for p in _unpack({k: v[rows] for k, v in b.items()}))


@needs_multi30k
def test_every_pair_once_per_stream_epoch(small):
  """4 streams of 2 rows per step; stream s holds pairs [500 s, 500 (s + 1)) of the 2,000."""
  config, tokenizer, (src, tgt) = small
  it = ip.make_train_iterator(config, tokenizer)
  epoch_batches = it.epoch_batches
  assert len(epoch_batches) == 4 and 0.7 < it.packing_efficiency <= 1
  batches = [next(it) for _ in range(max(epoch_batches))]
  expected = [_expected_pairs(config, tokenizer, src[i:i + 500], tgt[i:i + 500])
              for i in range(0, 2000, 500)]
  assert sum(sum(c.values()) for c in expected) < 2000, 'max_length=32 should drop some pairs'
  for s in range(4):
    assert _stream_pairs(batches, s, 2, epoch_batches[s]) == expected[s]
  assert it.get_state() == {'num_streams': 4, 'positions': [
      [1, max(epoch_batches) - n] for n in epoch_batches]}
  assert all(v.shape == (8, 32) and v.dtype == np.int32 for v in batches[0].values())
  assert set(batches[0]) == set(ip.FEATURE_KEYS)
  it.close()


@needs_multi30k
def test_streams_read_tfds_files_directly_as_tfds_reads_them(small, monkeypatch):
  """Uneven even splits (2,000 pairs in 3 streams) read in one pass equal TFDS's own reader."""
  config, tokenizer, _ = small
  builder = ip.prepared_builder(config)
  assert ip._reads_files_directly(builder, config)
  direct = list(ip.read_streams(builder, config, tokenizer, [0, 1, 2], 3))
  monkeypatch.setattr(ip, '_reads_files_directly', lambda *args: False)
  for s in (2, 0):
    (stream, pairs, counts), = ip.read_streams(builder, config, tokenizer, [s], 3)
    assert stream == direct[s][0] == s and counts == direct[s][2]
    assert all(np.array_equal(a, b) for a, b in zip(
        dataclasses.astuple(pairs), dataclasses.astuple(direct[s][1]), strict=True))
  assert [c['read'] for _, _, c in direct] == [667, 667, 666]
  assert direct[0][1].source_tokens.dtype == np.uint16


@needs_multi30k
def test_splits_read_without_tensorflow_as_tfds_reads_them(small, tmp_path):
  """read_split parses TFDS's TFRecord files itself (importing TensorFlow would take longer
  than decoding a test set): the pairs TFDS's reader gives, and a damaged record is an error
  naming its file."""
  config, _, (src, tgt) = small
  builder = ip.prepared_builder(config)
  for split, count in (('val', 100), ('train', 2000)):
    tfds_pairs = ([], [])
    for s, t in ip._text_chunks(builder, config, split):
      tfds_pairs[0].extend(s)
      tfds_pairs[1].extend(t)
    assert ip._split_pairs(builder, config, split) == tfds_pairs and len(tfds_pairs[0]) == count
  assert (src, tgt) == tfds_pairs  # The fixture's own read_split of train.
  assert ip._masked_crc32c(b'123456789') == (((0xE3069283 >> 15) | (0xE3069283 << 17)) +
                                             0xA282EAD8) & 0xFFFFFFFF  # CRC-32C's check value.
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
  record_file = next(Path(builder.data_dir).glob('*-val.tfrecord*'))
  damaged = bytearray(record_file.read_bytes())
  damaged[len(damaged) // 2] ^= 0xFF
  copy = tmp_path / record_file.name
  copy.write_bytes(bytes(damaged))
  with pytest.raises(ip.DataError, match=f'{copy.name}: record .* damaged'):
    list(ip._tfrecords(str(copy), 0, 100))


@needs_multi30k
def test_cached_streams_give_the_same_batches_without_reading(small, tmp_path, monkeypatch):
  config, tokenizer, _ = small
  cache = tmp_path / 'train_tokens'
  first = ip.make_train_iterator(config, tokenizer, cache_dir=str(cache))
  batches = [next(first) for _ in range(3)]
  assert len(list(cache.iterdir())) == 4
  monkeypatch.setattr(ip, '_stream_chunks', _no_training)
  resumed = ip.make_train_iterator(config, tokenizer, cache_dir=str(cache),
                                   state={'num_streams': 4, 'positions': [[0, 1]] * 4})
  assert _same([next(resumed) for _ in range(2)], batches[1:])
  monkeypatch.undo()
  # Another max_length is another stream's content: read again, the old file replaced.
  shorter = _with_data(config, max_length=24)
  assert next(ip.make_train_iterator(shorter, tokenizer, cache_dir=str(cache)))['inputs'].shape \
      == (8, 24)
  assert len(list(cache.iterdir())) == 4


@needs_multi30k
def test_global_batches_do_not_depend_on_process_count(small):
  """1, 2 and 4 processes give the same global batches, across a stream's epoch boundary; the
  processes' states merged by elementwise max are the 1-process state and resume anywhere."""
  config, tokenizer, _ = small
  it = ip.make_train_iterator(config, tokenizer)
  steps = min(it.epoch_batches) + 2
  one = [next(it) for _ in range(steps)]
  for process_count in (2, 4):
    batches, its = _global_batches(config, tokenizer, process_count, steps)
    assert _same(batches, one), process_count
    merged = np.max([i.get_state()['positions'] for i in its], axis=0).tolist()
    assert {'num_streams': 4, 'positions': merged} == it.get_state()
    assert next(its[-1])['inputs'].shape == (8 // process_count, 32)
    for i in its:
      i.close()
  state = {'num_streams': 4, 'positions': merged}
  resumed, its = _global_batches(config, tokenizer, 4, 3, state=state)
  assert _same(resumed, [next(it) for _ in range(3)])
  for i in its + [it]:
    i.close()


@needs_multi30k
@pytest.mark.parametrize('where', ['random', 'epoch_end'])
def test_resume_equals_uninterrupted_stream(small, where):
  config, tokenizer, _ = small
  it = ip.make_train_iterator(config, tokenizer)
  k = min(it.epoch_batches) if where == 'epoch_end' else int(np.random.default_rng().integers(
      1, min(it.epoch_batches)))
  for _ in range(k):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  if where == 'epoch_end':
    assert [1, 0] in state['positions']
  resumed = ip.make_train_iterator(config, tokenizer, state=state)
  assert _same([next(it) for _ in range(5)], [next(resumed) for _ in range(5)]), k
  assert it.get_state() == resumed.get_state()
  with pytest.raises(ip.DataError, match=r'stream 1 is outside its epoch'):
    ip.make_train_iterator(config, tokenizer, state={
        'num_streams': 4, 'positions': [[0, 0], [0, 10**6], [0, 0], [0, 0]]})
  with pytest.raises(ip.DataError, match=r'no position for streams \[2, 3\].*elementwise max'):
    ip.make_train_iterator(config, tokenizer, state={
        'num_streams': 4, 'positions': [[0, 5], [0, 5], [-1, -1], [-1, -1]]})


@needs_multi30k
def test_unmappable_state_warns_and_starts_fresh_epochs(small, caplog):
  config, tokenizer, _ = small
  for state, epoch in (({'epoch': 2, 'batch_in_epoch': 7}, 3),  # Written by earlier code.
                       ({'num_streams': 2, 'positions': [[0, 4], [1, 0]]}, 1)):
    caplog.clear()
    with caplog.at_level('WARNING'):
      it = ip.make_train_iterator(config, tokenizer, state=state)
    assert 'cannot be mapped exactly' in caplog.text
    assert it.get_state() == {'num_streams': 4, 'positions': [[epoch, 0]] * 4}
    assert next(it)['inputs'].shape == (8, 32)
    it.close()


@needs_multi30k
def test_streams_must_divide_batch_and_processes(small):
  config, tokenizer, _ = small
  with pytest.raises(ip.DataError, match=r'batch_size=8 .*set data.num_streams to a divisor of 8'):
    ip.make_train_iterator(_with_data(config, num_streams=3), tokenizer)
  with pytest.raises(ip.DataError, match=r'num_streams=4 .* 8 processes; set data.num_streams '
                     'to a multiple of 8'):
    ip.make_train_iterator(config, tokenizer, process_index=0, process_count=8)
  with pytest.raises(ip.DataError, match='process_index 2 not in'):
    ip.make_train_iterator(config, tokenizer, process_index=2, process_count=2)


@needs_multi30k
def test_deterministic_under_seed(small):
  config, tokenizer, _ = small
  def first(cfg, n=4):
    it = ip.make_train_iterator(cfg, tokenizer)
    return [next(it) for _ in range(n)], it
  a, it = first(config)
  b, _ = first(config)
  assert _same(a, b)
  other = config.copy_and_resolve_references()
  other.seed = config.seed + 1
  c, _ = first(other)
  assert not _same(a, c)
  for _ in range(max(it.epoch_batches) - 4):  # Every stream's next epoch is shuffled anew.
    next(it)
  assert not np.array_equal(next(it)['targets'], a[0]['targets'])


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


def _no_network(*args, **kwargs):
  raise AssertionError('network used')


@needs_multi30k
def test_multi30k_builder_local_copy(tmp_path, monkeypatch):
  monkeypatch.setenv(ip.MULTI30K_ENV, str(MULTI30K))
  monkeypatch.setattr(ip.socket, 'create_connection', _no_network)
  monkeypatch.setattr(ip.tfds.download.DownloadManager, 'download', _no_network)
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
  for name in ip.Multi30k.SHA256:
    with gzip.open(gz_dir / f'{name}.gz', 'wb') as f:
      f.write((MULTI30K / name).read_bytes())
  monkeypatch.delenv(ip.MULTI30K_ENV, raising=False)
  monkeypatch.setattr(ip.socket, 'create_connection', lambda *a, **k: io.BytesIO())
  fake = lambda self, urls: {k: gz_dir / v.rsplit('/', 1)[1] for k, v in urls.items()}
  monkeypatch.setattr(ip.tfds.download.DownloadManager, 'download', fake)
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
def test_multi30k_vocab8000_packing_efficiency(tmp_path, monkeypatch):
  """Full-size recipe: 8k BPE trains fast and packing at max_length 64 is >= 90%."""
  monkeypatch.setenv(ip.MULTI30K_ENV, str(MULTI30K))
  config = multi30k.get_config()
  config.data.data_dir = str(tmp_path / 'tfds')
  tokenizer = ip.load_or_train_tokenizer(config, str(tmp_path / 'work'))
  assert tokenizer.vocab_size == 8000
  it = ip.make_train_iterator(config, tokenizer)
  assert it.packing_efficiency >= 0.90
  batch = next(it)
  assert batch['inputs'].shape == (32, 64)
  it.close()


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


def test_serving_reads_lines_as_decode_does(tmp_path):
  """serving.py repeats the line rules (it runs without the project): the same lines from
  files and pipes, the same error for invalid UTF-8."""
  spec = importlib.util.spec_from_file_location('serving_lines', Path(ip.__file__).parent /
                                                'serving.py')
  serving = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(serving)
  data = codecs.BOM_UTF8 + 'a\rb\r\n\n\u2028 c\x0b\nlast'.encode()
  path = tmp_path / 'lines.txt'
  path.write_bytes(data)
  assert serving.read_lines(str(path)) == text_io.read_lines(path) == ['a\rb', '', '\u2028 c\x0b',
                                                                   'last']
  streamed = []
  for module in (serving, text_io):
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    try:
      streamed.append([line for chunk in module.stream_lines(read_end) for line in chunk])
    finally:
      os.close(read_end)
  assert streamed[0] == streamed[1] == text_io.read_lines(path)
  path.write_bytes(b'fine\nG\xfcnter\n')
  errors = []
  for read in (serving.read_lines, text_io.read_lines):
    with pytest.raises(ValueError) as error:
      read(str(path))
    errors.append(str(error.value))
  assert errors[0] == errors[1] and ':2: invalid UTF-8' in errors[0]


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
  for name in ip.Multi30k.SHA256:
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
  for name in ip.Multi30k.SHA256:
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
