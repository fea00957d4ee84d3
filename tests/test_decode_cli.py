"""decode.py and checkpoint averaging on a tiny run trained on real Multi30k sentences."""

import dataclasses
import json
import os
import select
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import sacrebleu
from parity import assert_varied

from model import Transformer
from nmt import checkpoints, runs, sharding
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.environ.get('MULTI30K_DIR', '')


@pytest.fixture
def workdir(trained_run):
  return trained_run


def run_decode(*args, stdin=None):
  return subprocess.run([sys.executable, 'decode.py', *args], cwd=REPO, input=stdin,
                        capture_output=True, timeout=600)


def test_decode_keeps_line_count_and_order_and_scores_like_sacrebleu(workdir, tmp_path):
  sources = [line.strip() for line in open(os.path.join(MULTI30K, 'val.en'), encoding='utf-8')]
  references = [line.strip() for line in open(os.path.join(MULTI30K, 'val.de'), encoding='utf-8')]
  # Mixed lengths out of order, an empty line in the middle, a line longer than the model.
  picked = [5, 0, 17, 3, 40, 8]
  lines = [sources[i] for i in picked]
  refs = [references[i] for i in picked]
  lines.insert(3, '')
  refs.insert(3, '')
  lines.append(' '.join(sources[:40]))  # ~500 tokens > model.max_len=128: truncated.
  refs.append(references[0])
  (tmp_path / 'src.txt').write_text(''.join(x + '\n' for x in lines), encoding='utf-8')
  (tmp_path / 'ref.txt').write_text(''.join(x + '\n' for x in refs), encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(tmp_path / 'src.txt'), '--output',
                      str(tmp_path / 'hyp.txt'), '--reference', str(tmp_path / 'ref.txt'))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  hypotheses = (tmp_path / 'hyp.txt').read_text(encoding='utf-8').split('\n')[:-1]
  assert len(hypotheses) == len(lines)
  assert hypotheses[3] == ''
  assert_varied(hypotheses)
  stderr = result.stderr.decode()
  assert 'truncating 1 sequence(s)' in stderr
  expected = sacrebleu.corpus_bleu(hypotheses, [refs]).score
  printed = [line for line in stderr.splitlines() if line.startswith('BLEU ')][0]
  assert float(printed.split()[1]) == pytest.approx(expected, abs=0.01)
  assert 'chrF' in stderr and 'nrefs:1' in stderr

  # Order: each line translated alone gives the same output as inside the file.
  config, tokenizer, model = runs.load_run(workdir)
  translator = translator_lib.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = runs.load_params(workdir, translator.mesh)
  for position in (0, 2, 5):
    assert translator(params, [lines[position]]) == [hypotheses[position]]


def test_a_translation_with_line_breaks_or_tabs_stays_on_its_line():
  """Byte-fallback pieces can decode to any character; a newline in one translation used to
  shift every later output line against its input."""
  import decode
  assert decode.output_line(['a\nb', 'c\td\r\ne']) == 'a b\tc d e'
  assert decode.output_line(['x\u2028y']) == 'x y'
  assert decode.output_line(['']) == ''


def test_decode_stdin_to_stdout_and_nbest(workdir):
  result = run_decode('--workdir', workdir, '--input', '-', '--nbest', '2',
                      stdin=b'A dog runs.\nTwo men.\n')
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  lines = result.stdout.decode().split('\n')[:-1]
  assert len(lines) == 2 and all(len(line.split('\t')) == 2 for line in lines)


def test_decode_errors_are_clear(workdir, tmp_path):
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'A dog.\nA \xff cat.\n')
  result = run_decode('--workdir', workdir, '--input', str(bad))
  assert result.returncode != 0
  assert f'{bad}:2: invalid UTF-8' in result.stderr.decode()
  empty = tmp_path / 'empty_run'
  empty.mkdir()
  (empty / 'config.json').write_text(open(os.path.join(workdir, 'config.json')).read())
  (empty / 'tokenizer.model').write_bytes(open(os.path.join(workdir, 'tokenizer.model'),
                                               'rb').read())
  good = tmp_path / 'good.txt'
  good.write_text('A dog.\n', encoding='utf-8')
  result = run_decode('--workdir', str(empty), '--input', str(good))
  assert result.returncode != 0 and 'No checkpoints' in result.stderr.decode()
  assert 'Traceback' not in result.stderr.decode()


def test_checkpoint_averaging(workdir, tmp_path):
  workdir = shutil.copytree(workdir, tmp_path / 'run')  # Averaging writes into the run.
  steps = checkpoints.saved_steps(workdir)[-2:]
  assert len(steps) == 2
  by_step = [checkpoints.load_params(workdir, step)[0] for step in steps]
  averaged = checkpoints.save_averaged(workdir, 2)
  assert averaged == steps
  loaded, origin = checkpoints.load_params(workdir, 'averaged')
  assert 'averaged' in origin
  by_step, loaded = jax.device_get((by_step, loaded))
  for a, b, mean in zip(*(jax.tree_util.tree_leaves(t) for t in (*by_step, loaded))):
    np.testing.assert_allclose(mean, (a + b) / 2, rtol=1e-6, atol=1e-7)
  differs = any(not np.array_equal(a, b) for a, b in zip(
      *(jax.tree_util.tree_leaves(t) for t in by_step)))
  assert differs  # Averaging two different checkpoints is not trivially the identity.


@pytest.mark.parametrize('flag, message', [
    ('--beam_size=0', 'beam_size'), ('--beam_size=-2', 'beam_size'), ('--nbest=0', 'nbest'),
    ('--batch_tokens=0', 'batch_tokens')])
def test_bad_decode_flags_fail_in_one_line_before_any_work(tmp_path, flag, message):
  """Before: --beam_size 0 silently became the run's beam, -2 and --nbest 0 gave tracebacks."""
  result = run_decode('--workdir', str(tmp_path), '--input', '-', flag, stdin=b'A dog.\n')
  stderr = result.stderr.decode()
  assert result.returncode != 0 and message in stderr and 'Traceback' not in stderr, stderr


def test_output_in_a_missing_folder_fails_before_translating(workdir, tmp_path):
  result = run_decode('--workdir', workdir, '--input', '-', '--output',
                      str(tmp_path / 'no' / 'such' / 'hyp.txt'), stdin=b'A dog.\n')
  stderr = result.stderr.decode()
  assert result.returncode != 0 and 'does not exist' in stderr and 'Translating' not in stderr
  assert len(stderr.strip().splitlines()) == 1, stderr  # Before: absl's 29 lines of flag help.


@pytest.mark.parametrize('flags, message', [
    (('--beam_size=2', '--nbest=3'), 'nbest'),
    (('--beam_size=100000',), 'beam_size must be between 1 and the vocabulary size')])
def test_nbest_above_the_beam_and_a_beam_above_the_vocabulary_are_one_clear_error(
    workdir, flags, message):
  """Before: a beam of 100,000 tried to allocate terabytes."""
  result = run_decode('--workdir', workdir, '--input', '-', *flags, stdin=b'A dog.\n')
  stderr = result.stderr.decode()
  assert result.returncode != 0 and message in stderr and 'Traceback' not in stderr, stderr


def test_stdin_from_a_pipe_is_translated_line_by_line_as_it_arrives(workdir):
  """Each translation comes out before the next line is written, the pipe still open."""
  lines = ['A dog runs in the snow.', '', 'Two men are playing football on a green field.']
  process = subprocess.Popen([sys.executable, 'decode.py', '--workdir', workdir, '--input', '-'],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
  outputs = []
  try:
    for line in lines:
      process.stdin.write(line.encode() + b'\n')
      process.stdin.flush()
      ready, _, _ = select.select([process.stdout], [], [], 300)
      assert ready, 'no translation within 300 s of writing a line'
      outputs.append(process.stdout.readline().decode().rstrip('\n'))
    process.stdin.close()
    assert process.wait(timeout=120) == 0, process.stderr.read().decode()[-3000:]
  finally:
    process.kill()
  config, tokenizer, model = runs.load_run(workdir)
  translator = translator_lib.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = runs.load_params(workdir, translator.mesh)
  assert_varied(outputs, share=1.0)
  assert outputs == translator(params, lines)
  assert outputs[1] == ''


def test_json_output_gives_nbest_scores_pieces_and_token_log_probs(workdir):
  result = run_decode('--workdir', workdir, '--input', '-', '--nbest', '2', '--output_format',
                      'json', stdin=b'A dog runs.\n\nTwo men.\n')
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  entries = [json.loads(line) for line in result.stdout.decode().split('\n')[:-1]]
  assert [e['source'] for e in entries] == ['A dog runs.', '', 'Two men.']
  assert entries[1]['translations'] == []
  for entry in (entries[0], entries[2]):
    assert len(entry['translations']) == 2
    assert entry['translations'][0]['score'] >= entry['translations'][1]['score']
    for hypothesis in entry['translations']:
      assert hypothesis['tokens'][-1] == '</s>'
      assert len(hypothesis['tokens']) == len(hypothesis['token_log_probs'])
      assert sum(hypothesis['token_log_probs']) == pytest.approx(hypothesis['log_prob'],
                                                                 abs=1e-4)
      # One alignment per target piece, into the source's pieces (EOS included).
      assert len(hypothesis['align']) == len(hypothesis['tokens'])
      assert all(0 <= j < len(entry['source_tokens']) for j in hypothesis['align'])
      assert 'attention' not in hypothesis
    assert entry['source_tokens'][-1] == '</s>'


def test_score_reference_gives_the_searchs_own_scores_and_the_attention(workdir, tmp_path):
  """Scoring the search's own best translations gives back its per-token log-probabilities
  (forced decoding, a full forward pass, against the search's incremental decoding)."""
  source = tmp_path / 'src.txt'
  source.write_text('A dog runs in the snow.\nTwo men talk.\nA woman sings a song.\n',
                    encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(source), '--output_format', 'json',
                      '--attention')
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  searched = [json.loads(line)['translations'][0]
              for line in result.stdout.decode().split('\n')[:-1]]
  assert len({s['text'] for s in searched}) == 3  # Varied translations.
  for s in searched:
    assert len(s['attention']) == len(s['tokens'])
    assert all(sum(row) == pytest.approx(1.0, abs=1e-3) for row in s['attention'])
    assert s['align'] == [int(np.argmax(row)) for row in s['attention']]
  reference = tmp_path / 'ref.txt'
  reference.write_text(''.join(s['text'] + '\n' for s in searched), encoding='utf-8')
  scored = run_decode('--workdir', workdir, '--input', str(source), '--reference',
                      str(reference), '--score_reference', '--output_format', 'json')
  assert scored.returncode == 0, scored.stderr.decode()[-3000:]
  for line, s in zip(scored.stdout.decode().split('\n')[:-1], searched, strict=True):
    entry = json.loads(line)
    assert entry['reference'] == s['text'] and entry['tokens'] == s['tokens']
    np.testing.assert_allclose(entry['token_log_probs'], s['token_log_probs'], atol=1e-4)
    assert entry['align'] == s['align']
  plain = run_decode('--workdir', workdir, '--input', str(source), '--reference',
                     str(reference), '--score_reference')
  assert plain.returncode == 0, plain.stderr.decode()[-3000:]
  assert [float(x) for x in plain.stdout.decode().split()] == pytest.approx(
      [s['log_prob'] for s in searched], abs=1e-4)
  missing = run_decode('--workdir', workdir, '--input', str(source), '--score_reference')
  assert missing.returncode == 1 and b'--reference' in missing.stderr


def test_target_prefixes_are_kept_verbatim_and_continued(workdir, tmp_path):
  sources = ['A dog runs in the snow.', 'Two men talk.', 'A woman sings.']
  prefixes = ['Ein Hund', '', 'Eine Frau singt,']
  (tmp_path / 'src.txt').write_text(''.join(x + '\n' for x in sources), encoding='utf-8')
  (tmp_path / 'prefix.txt').write_text(''.join(x + '\n' for x in prefixes), encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(tmp_path / 'src.txt'),
                      '--target_prefix', str(tmp_path / 'prefix.txt'))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  lines = result.stdout.decode().split('\n')[:-1]
  assert lines[0].startswith('Ein Hund') and lines[2].startswith('Eine Frau singt,')
  assert len(lines[0]) > len('Ein Hund')  # Continued past the prefix.
  config, tokenizer, model = runs.load_run(workdir)
  translator = translator_lib.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = runs.load_params(workdir, translator.mesh)
  assert lines[1] == translator(params, [sources[1]])[0]  # No prefix: unchanged.
  # A trailing space (typed after a word) is not forced as a piece of its own.
  detailed = translator_lib.Translator(model, tokenizer, config.decode, translator.mesh,
                                    details=True)
  spaced, plain = (detailed(params, sources[:1], prefixes=[p])[0][0]
                   for p in ('Ein Hund ', 'Ein Hund'))
  assert spaced['tokens'] == plain['tokens'] and spaced['text'].startswith('Ein Hund ')
  (tmp_path / 'short.txt').write_text('Ein Hund\n', encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(tmp_path / 'src.txt'),
                      '--target_prefix', str(tmp_path / 'short.txt'))
  stderr = result.stderr.decode()
  assert result.returncode == 1 and 'one line per source line' in stderr, stderr
  assert 'Traceback' not in stderr
  # A prefix piece the output layer does not score (output_vocab_size) is a clear error, not
  # a search in which no token is allowed.
  prefix_ids = tokenizer.encode(['Eine Frau'])[0][:-1]
  smaller = Transformer(dataclasses.replace(model.config, output_vocab_size=int(
      prefix_ids.max())))
  limited = translator_lib.Translator(smaller, tokenizer, config.decode, translator.mesh)
  with pytest.raises(ValueError, match=r"target prefix 2 holds the piece '.*', which no "
                     r'training target held.*output_vocab_size='):
    limited(params, sources[:2], prefixes=['', 'Eine Frau'])


def test_an_ensemble_of_two_checkpoints_translates_and_bad_weights_are_one_line(workdir):
  result = run_decode('--workdir', workdir, '--checkpoint', '300', '--input', '-', '--ensemble',
                      f'{workdir}:200', '--ensemble_weights', '2,1', stdin=b'A dog.\n\nTwo men.\n')
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  lines = result.stdout.decode().split('\n')[:-1]
  assert len(lines) == 3 and lines[1] == '' and lines[0]
  assert 'an ensemble of' in result.stderr.decode()
  # An ensemble of a checkpoint with itself is that checkpoint.
  source = b'A dog runs in the snow.\nTwo men are talking.\nA woman sings a song.\n'
  alone, twice = (run_decode('--workdir', workdir, '--checkpoint', '300', '--input', '-', *extra,
                             stdin=source) for extra in ((), ('--ensemble', f'{workdir}:300')))
  assert alone.returncode == twice.returncode == 0, twice.stderr.decode()[-3000:]
  assert_varied(alone.stdout.decode().split('\n')[:-1], share=1.0)
  assert twice.stdout == alone.stdout
  result = run_decode('--workdir', workdir, '--input', '-', '--ensemble', f'{workdir}:200',
                      '--ensemble_weights', '1', stdin=b'A dog.\n')
  stderr = result.stderr.decode()
  assert result.returncode == 1 and '1 weights for 2 models' in stderr, stderr
  assert 'Traceback' not in stderr


def test_an_ensemble_member_with_another_tokenizer_is_refused(workdir, tmp_path):
  import sentencepiece as spm

  other = tmp_path / 'other_run'
  shutil.copytree(workdir, other)
  text = tmp_path / 'text.txt'
  text.write_text('a dog runs\ntwo men talk\na woman sings\n' * 20, encoding='utf-8')
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / 'spm'),
                                 vocab_size=30, model_type='bpe', pad_id=0, eos_id=1, unk_id=2,
                                 bos_id=-1, minloglevel=2)
  shutil.copy(tmp_path / 'spm.model', other / 'tokenizer.model')
  config, tokenizer, model = runs.load_run(workdir)
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(workdir, mesh)
  with pytest.raises(ValueError, match='has another tokenizer'):
    runs.load_ensemble(str(other), None, tokenizer, mesh, model, params, origin)


@pytest.mark.parametrize('flags, message', [
    (('--split', 'val', '--reference', 'ref.txt'), '--reference goes with --input'),
    (('--input', '-', '--output', '.'), 'is a folder'),
    (('--input', '-', '--alpha', 'nan'), 'must be a finite number >= 0'),
    (('--input', '-', '--alpha', '-1'), 'must be a finite number >= 0'),
    (('--input', '-', '--checkpoint', '300', '--average_last', '2'), 'not both'),
    (('--input', '-', '--ensemble', 'WORKDIR:200', '--ensemble_weights', 'a,b'),
     'comma-separated numbers'),
    (('--input', '-', '--target_prefix', 'prefix.txt'), 'not a pipe'),
    (('--input', '-', '--min_length', '500'), 'min_length must be between 0 and')])
def test_conflicting_or_invalid_decode_flags_are_one_line_errors(workdir, tmp_path, flags,
                                                                 message):
  """Before: --checkpoint with --average_last and --split with --reference silently ignored
  one of them; --alpha nan gave empty translations with exit status 0."""
  (tmp_path / 'prefix.txt').write_text('Ein\n', encoding='utf-8')
  flags = [f.replace('WORKDIR', workdir) for f in flags]
  result = subprocess.run([sys.executable, os.path.join(REPO, 'decode.py'), '--workdir', workdir,
                           *flags], cwd=tmp_path, input=b'A dog.\n', capture_output=True,
                          timeout=600)
  stderr = result.stderr.decode()
  assert result.returncode == 1 and message in stderr and 'Traceback' not in stderr, stderr


def test_a_failed_call_leaves_an_existing_output_file_as_it_was(workdir, tmp_path):
  """Before: the output was opened (emptied) before the ensemble weights were checked."""
  source, output = tmp_path / 'src.txt', tmp_path / 'hyp.txt'
  source.write_text('A dog.\n', encoding='utf-8')
  output.write_text('precious\n', encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(source), '--output', str(output),
                      '--ensemble', f'{workdir}:200', '--ensemble_weights', '0,0')
  assert result.returncode == 1 and 'not all 0' in result.stderr.decode()
  assert output.read_text(encoding='utf-8') == 'precious\n'
  empty = tmp_path / 'empty.txt'
  empty.write_text('', encoding='utf-8')
  result = run_decode('--workdir', workdir, '--input', str(empty), '--reference', str(empty),
                      '--output', str(output))
  stderr = result.stderr.decode()
  assert result.returncode == 0 and 'nothing to score' in stderr and 'Traceback' not in stderr
  assert output.read_text(encoding='utf-8') == ''
