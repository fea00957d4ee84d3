"""Tests for input_pipeline.py, mostly on real Multi30k text ($MULTI30K_DIR or ../shared/data).

Tests that need the Multi30k files are skipped when they are absent.
"""

import collections
import gzip
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import input_pipeline as ip
from configs import multi30k

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
    _write(folder, f'train.{lang}', ip.read_lines(MULTI30K / f'train.{lang}')[:2000])
    _write(folder, f'val.{lang}', ip.read_lines(MULTI30K / f'val.{lang}')[:100])
  config = _config(tmp, folder)
  tokenizer = ip.load_or_train_tokenizer(config, str(tmp / 'work'))
  return config, tokenizer, ip.read_split(config, 'train')


def _unpack(batch):
  """Yields (src_ids, tgt_ids) tuples of a packed batch, checking the row layout."""
  for r in range(batch['inputs'].shape[0]):
    segs = {}
    for side in ('inputs', 'targets'):
      seg, pos, ids = (batch[side + k][r] for k in ('_segmentation', '_positions', ''))
      assert np.all(ids[seg == 0] == ip.PAD_ID) and np.all(pos[seg == 0] == 0)
      n = int((seg > 0).sum())
      assert np.all(seg[n:] == 0), 'padding only at the end of a row'
      assert np.all(np.diff(seg[:n]) >= 0) and (n == 0 or seg[0] == 1)
      for s in np.unique(seg[:n]):
        m = seg == s
        assert np.array_equal(pos[m], np.arange(m.sum())), 'positions restart per segment'
        assert ids[m][-1] == ip.EOS_ID and np.all(ids[m][:-1] != ip.EOS_ID)
        segs.setdefault(int(s), {})[side] = tuple(ids[m].tolist())
    for s in sorted(segs):
      assert set(segs[s]) == {'inputs', 'targets'}, 'segment ids shared by both sides'
      yield segs[s]['inputs'], segs[s]['targets']


def _epoch_pairs(it, n):
  return [p for _ in range(n) for p in _unpack(next(it))]


def _expected_pairs(config, tokenizer, src, tgt):
  s, t = tokenizer.encode(src), tokenizer.encode(tgt)
  return collections.Counter(
      (tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(s, t, strict=True)
      if len(a) <= config.data.max_length and len(b) <= config.data.max_length)


@needs_multi30k
def test_tokenizer_round_trip_without_unk(small):
  _, tokenizer, _ = small
  texts = ip.read_lines(MULTI30K / 'test_2016_flickr.de')[:200] + [
      'Ein Hund 🐕 läuft über die Straße.', '猫がマットの上に座っている。', 'Ça coûte 5 € — ok?',
      'Zwei  Leerzeichen', '']
  ids = tokenizer.encode(texts)
  assert tokenizer.vocab_size == 1000
  for text, x in zip(texts, ids, strict=True):
    assert x.dtype == np.int32 and x[-1] == ip.EOS_ID
    assert ip.UNK_ID not in x and ip.PAD_ID not in x
    assert tokenizer.decode(x) == text
  padded = np.zeros((2, 40), np.int32)
  padded[0, :len(ids[0])] = ids[0]
  padded[1, :len(ids[-2])] = ids[-2]
  padded[1, len(ids[-2])] = 7  # Anything after EOS is ignored.
  assert tokenizer.decode_batch(padded) == [texts[0], texts[-2]]


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
  monkeypatch.setattr(ip, 'read_split', _no_training)
  monkeypatch.setattr(ip.spm.SentencePieceTrainer, 'train', _no_training)
  reused = ip.load_or_train_tokenizer(config2, str(tmp_path / 'a'))
  assert reused.vocab_size == a.vocab_size == config.model.vocab_size
  assert (tmp_path / 'a' / 'tokenizer.model').read_bytes() == bytes_a


@needs_multi30k
def test_tokenizer_of_another_vocab_size_is_refused(small, tmp_path, monkeypatch):
  config, tokenizer, _ = small
  path = tmp_path / 'tokenizer.model'
  path.write_bytes(tokenizer._sp.serialized_model_proto())
  monkeypatch.setattr(ip, 'read_split', _no_training)
  monkeypatch.setattr(ip.spm.SentencePieceTrainer, 'train', _no_training)
  assert ip.load_or_train_tokenizer(config, str(tmp_path)).vocab_size == 1000
  other = config.copy_and_resolve_references()
  other.model.vocab_size = 600
  with pytest.raises(ip.DataError, match=r'tokenizer\.model has 1000 pieces.*vocab_size is 600'):
    ip.load_or_train_tokenizer(other, str(tmp_path))
  assert path.read_bytes() == tokenizer._sp.serialized_model_proto()  # Left as it was.


@needs_multi30k
def test_one_epoch_packs_every_pair_exactly_once(small):
  config, tokenizer, (src, tgt) = small
  it = ip.make_train_iterator(config, tokenizer)
  expected = _expected_pairs(config, tokenizer, src, tgt)
  assert sum(expected.values()) < len(src), 'max_length=32 should drop some pairs'
  got = collections.Counter(_epoch_pairs(it, it.num_batches))
  assert got == expected
  assert it.get_state() == {'epoch': 1, 'batch_in_epoch': 0}
  assert 0.7 < it.packing_efficiency <= 1  # Short rows (32) fit ~2 pairs; see 64 below.
  batch = next(it)
  assert set(batch) == set(ip.FEATURE_KEYS)
  assert all(v.shape == (8, 32) and v.dtype == np.int32 for v in batch.values())
  it.close()


@needs_multi30k
def test_process_shards_disjoint_and_complete(small):
  config, tokenizer, (src, tgt) = small
  shards = [ip.make_train_iterator(config, tokenizer, process_index=p, process_count=2)
            for p in range(2)]
  assert shards[0].num_batches == shards[1].num_batches
  pairs = []
  for it in shards:
    b = next(it)
    assert b['inputs'].shape == (4, 32)
    pairs.append(collections.Counter(_epoch_pairs(it, it.num_batches - 1) + list(_unpack(b))))
  assert not set(pairs[0]) & set(pairs[1])
  assert pairs[0] + pairs[1] == _expected_pairs(config, tokenizer, src, tgt)
  with pytest.raises(ip.DataError, match='batch_size=8 rows do not divide over 3 hosts'):
    ip.make_train_iterator(config, tokenizer, process_count=3)


def test_rows_per_host():
  assert ip.rows_per_host(32, 1) == 32
  assert ip.rows_per_host(32, 4) == 8
  with pytest.raises(ip.DataError, match='multiple of 3'):
    ip.rows_per_host(32, 3)


@needs_multi30k
def test_deterministic_under_seed(small):
  config, tokenizer, _ = small
  def first(cfg, n=4):
    it = ip.make_train_iterator(cfg, tokenizer)
    return [next(it)['targets'] for _ in range(n)], it
  a, it = first(config)
  b, _ = first(config)
  assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
  other = config.copy_and_resolve_references()
  other.seed = config.seed + 1
  c, _ = first(other)
  assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
  for _ in range(it.num_batches - 4):  # Next epoch is shuffled differently.
    next(it)
  assert not np.array_equal(next(it)['targets'], a[0])


@needs_multi30k
@pytest.mark.parametrize('k', [3, 'epoch_end'])
def test_resume_continues_at_next_batch(small, k):
  config, tokenizer, _ = small
  it = ip.make_train_iterator(config, tokenizer)
  k = it.num_batches - 1 if k == 'epoch_end' else k
  for _ in range(k):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  resumed = ip.make_train_iterator(config, tokenizer, state=state)
  for _ in range(3):  # Crosses the epoch boundary for 'epoch_end'.
    x, y = next(it), next(resumed)
    assert all(np.array_equal(x[f], y[f]) for f in ip.FEATURE_KEYS)
  assert it.get_state() == resumed.get_state()
  with pytest.raises(ValueError, match='batch_in_epoch'):
    ip.make_train_iterator(config, tokenizer, state={'epoch': 0, 'batch_in_epoch': 10**6})


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
    ip.read_lines(folder / 'train.de')
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
    assert src == [x.strip() for x in ip.read_lines(MULTI30K / f'{split}.en')]
    assert tgt == [x.strip() for x in ip.read_lines(MULTI30K / f'{split}.de')]
  config.data.target_lang = 'fr'
  assert ip.read_split(config, 'val')[1][0] == ip.read_lines(MULTI30K / 'val.fr')[0].strip()
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
  assert ip.read_split(config, 'val')[0][:2] == ip.read_lines(MULTI30K / 'val.en')[:2]
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
  assert ip.read_lines('-') == ['a dog', '', 'über 🐕', 'no newline']
  monkeypatch.setattr(sys, 'stdin', Stdin(b'one\n'))
  assert ip.read_lines('-') == ['one']  # A final newline ends the last line, adds none.
  monkeypatch.setattr(sys, 'stdin', Stdin(b''))
  assert ip.read_lines('-') == []
  monkeypatch.setattr(sys, 'stdin', Stdin('x\nG\xfcnter\n'.encode('latin-1')))
  with pytest.raises(ip.DataError, match=r'stdin:2: invalid UTF-8'):
    ip.read_lines('-')


def _seq(rng, n: int) -> np.ndarray:
  """n - 1 random non-special ids and EOS."""
  return np.append(rng.integers(3, 100, size=n - 1), ip.EOS_ID).astype(np.int32)


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
    return x if limit is None or len(x) <= limit else np.append(x[:limit - 1], ip.EOS_ID)

  for limit in (None, max_length):
    batches = ip.length_batches(sides, budget, max_length=limit, row_multiple=row_multiple)
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
          assert np.array_equal(ids[r, :len(x)], x) and np.all(ids[r, len(x):] == ip.PAD_ID)
        assert np.all(ids[len(idx):] == ip.PAD_ID)
      if limit is not None:
        assert length <= _round_up(limit, 8)
        lengths = (arrays['inputs'][:len(idx)] != ip.PAD_ID).sum(1)
        assert np.all(lengths <= limit)
    # Untruncated, the 300-token source is too long for any batch of 256 tokens.
    assert lone_oversize == (1 if limit is None else 0)
  # Truncation ends in EOS and happens on copies: the caller's sequences are unchanged.
  assert all(np.array_equal(a, b) for side in sides
             for a, b in zip(sides[side], originals[side], strict=True))
  truncated = ip.length_batches(sides, budget, max_length=max_length)
  for idx, arrays in truncated:
    for r, i in enumerate(idx):
      if i == count - 2:
        assert arrays['inputs'][r, max_length - 1] == ip.EOS_ID
        assert np.array_equal(arrays['inputs'][r, :max_length - 1],
                              originals['inputs'][i][:max_length - 1])


def test_length_batches_single_side_and_length_multiple():
  rng = np.random.default_rng(0)
  seqs = [_seq(rng, n) for n in (5, 17, 3, 16, 9)]
  batches = ip.length_batches({'inputs': seqs}, max_batch_tokens=64, length_multiple=16)
  assert [(idx.tolist(), a['inputs'].shape) for idx, a in batches] == [
      ([0, 2, 3, 4], (4, 16)), ([1], (1, 32))]


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
  assert ip.read_split(config, 'val')[1][0] == ip.read_lines(MULTI30K / 'val.de')[0].strip()
  lines = ip.read_lines(local / 'val.de')
  (local / 'val.de').write_text('\n'.join(['Ein geänderter Satz.'] + lines[1:]) + '\n',
                                encoding='utf-8')
  assert ip.read_split(config, 'val')[1][:2] == ['Ein geänderter Satz.', lines[1].strip()]
  # An emptied folder is an error naming the missing files, not the old cache.
  for name in ip.Multi30k.SHA256:
    (local / name).unlink()
  with pytest.raises(FileNotFoundError, match=r'lacks.*train\.en'):
    ip.read_split(config, 'val')
