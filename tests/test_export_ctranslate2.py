"""export.py --format ctranslate2: CTranslate2 scores and translates as our model does."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from test_train import _setup, small_config

import export
from model import EOS_ID, Transformer, TransformerConfig, transformer_beam_search
from model.forced_decoding import forced_decoding
from nmt import batching, runs, sharding, text_io

ctranslate2 = pytest.importorskip(
    'ctranslate2', reason="needs the ctranslate2 extra: pip install -e '.[ctranslate2]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def val_sentences(count):
  folder = os.environ['MULTI30K_DIR']
  read = lambda lang: text_io.read_lines(os.path.join(folder, f'val.{lang}'))[:count]
  return read('en'), read('de')


@pytest.fixture(scope='module')
def converted(trained_run, tmp_path_factory):
  """The tiny run's newest checkpoint as a CTranslate2 folder, and the run loaded here."""
  folder = str(tmp_path_factory.mktemp('ct2'))
  export.export(trained_run, folder, format='ctranslate2')
  config, tokenizer, model = runs.load_run(trained_run)
  mesh = sharding.make_mesh()
  params, _ = runs.load_params(trained_run, mesh)
  return folder, config, tokenizer, model, params, mesh


def pieces(tokenizer, texts):
  return [tokenizer._sp.encode(text, out_type=str) for text in texts]


def test_teacher_forced_log_probabilities_equal_ours(converted):
  folder, _, tokenizer, model, params, _ = converted
  # Of the first pairs, 12 whose targets hold only pieces the output layer scores (the
  # run's covers the pieces of its training targets).
  pairs = [(s, t) for s, t in zip(*val_sentences(100))
           if tokenizer.encode([t])[0].max() < model.config.num_outputs][:12]
  assert len(pairs) == 12
  sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
  scored = ctranslate2.Translator(folder, intra_threads=1).score_batch(
      pieces(tokenizer, sources), pieces(tokenizer, targets))
  (order, arrays), = batching.length_batches(
      {'inputs': tokenizer.encode(sources), 'targets': tokenizer.encode(targets)}, 1 << 20)
  logits = model.apply({'params': params}, arrays['inputs'], arrays['targets'])
  ours = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                            arrays['targets'][..., None], axis=-1)[..., 0]
  for row, i in enumerate(order):
    theirs = np.asarray(scored[i].log_probs)  # Every target token and the EOS.
    assert len(theirs) == len(tokenizer.encode([targets[i]])[0])
    np.testing.assert_allclose(theirs, ours[row, :len(theirs)], atol=1e-4)


@pytest.fixture(scope='module')
def copy_model():
  """A model trained 150 steps on copying 3-7 random tokens: its outputs end by themselves,
  at varied lengths, and are right only in part (a 12-step Multi30k run repeats one token up
  to the length limit, where the two searches' limits count differently)."""
  config = small_config({'model.d_model': 64, 'model.d_ff': 128, 'model.num_heads': 4,
                         'optimizer.warmup_steps': 50, 'optimizer.learning_rate_scale': 0.5,
                         'optimizer.label_smoothing': 0.0})
  state, step_fn, batch_sharding = _setup(config, jax.devices()[:1], vocab=16)
  rng = np.random.default_rng(0)
  for _ in range(150):
    tokens = copy_sources(rng, 32)
    segments = (tokens > 0).astype(np.int32)
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), tokens.shape)
    batch = {'inputs': tokens, 'targets': tokens, 'inputs_segmentation': segments,
             'targets_segmentation': segments, 'inputs_positions': positions,
             'targets_positions': positions}
    state, _ = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
  model = Transformer(TransformerConfig(**config.model))
  return model, jax.device_get(state['params'])


def copy_sources(rng, count):
  """[count, 8]: 3-7 random tokens in [3, 16), EOS, then padding."""
  lengths = rng.integers(3, 8, count)
  tokens = rng.integers(3, 16, (count, 8)).astype(np.int32)
  tokens = np.where(np.arange(8) < lengths[:, None], tokens, 0)
  tokens[np.arange(count), lengths] = EOS_ID
  return tokens


def test_beam_search_translations_equal_ours(copy_model):
  """alpha 0 on both sides: CTranslate2's length penalty (length ** alpha) is not GNMT's."""
  model, params = copy_model
  pieces = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(3, 16)]
  folder = tempfile.mkdtemp(prefix='ct2_copy_')
  export.ctranslate2_spec(model.config, params, pieces).save(folder)
  inputs = copy_sources(np.random.default_rng(7), 64)
  sequences, _ = transformer_beam_search(model, params, inputs, beam_size=4, alpha=0.0,
                                         max_extra_length=20, stopping='exact')
  ours = [[pieces[t] for t in row[:list(row).index(EOS_ID)]]
          for row in np.asarray(sequences)[:, 0]]
  sources = [[pieces[t] for t in row if t > EOS_ID] for row in inputs]
  limit = 20
  results = ctranslate2.Translator(folder, intra_threads=1).translate_batch(
      sources, beam_size=4, length_penalty=0.0, max_decoding_length=limit)
  theirs = [result.hypotheses[0] for result in results]
  # Where CTranslate2's best hypothesis reached max_decoding_length it is returned cut, without
  # an end, and ranked by its score so far; ours must end within a longer limit. Such a model
  # repeating itself is rare here; every other sentence gets the same translation.
  cut = [i for i, hypothesis in enumerate(theirs) if len(hypothesis) == limit]
  assert len(cut) <= 2, [theirs[i] for i in cut]
  assert ([x for i, x in enumerate(theirs) if i not in cut] ==
          [x for i, x in enumerate(ours) if i not in cut])
  copied = sum(out == src for out, src in zip(ours, sources))
  assert len({len(x) for x in ours}) >= 4 and 0 < copied < len(ours), copied


def test_an_output_layer_over_the_first_ids_gives_a_target_vocabulary_of_them(copy_model,
                                                                              tmp_path):
  """output_vocab_size=12 of 16 pieces: the target vocabulary holds the first 12, the
  source all 16, and CTranslate2 scores targets as our smaller output layer does."""
  model, params = copy_model
  outputs = 12
  smaller = Transformer(dataclasses.replace(model.config, output_vocab_size=outputs))
  pieces = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(3, 16)]
  export.ctranslate2_spec(smaller.config, params, pieces).save(str(tmp_path))
  read = lambda name: json.loads((tmp_path / name).read_text())
  assert read('target_vocabulary.json') == pieces[:outputs]
  assert read('source_vocabulary.json') == pieces
  rng = np.random.default_rng(9)
  inputs = copy_sources(rng, 16)  # Sources of every piece, targets of the first 12 only.
  targets = np.where(inputs > EOS_ID, rng.integers(3, outputs, inputs.shape), inputs)
  ours, _ = forced_decoding(smaller, params, inputs, targets)
  scored = ctranslate2.Translator(str(tmp_path), intra_threads=1).score_batch(
      [[pieces[t] for t in row if t > EOS_ID] for row in inputs],
      [[pieces[t] for t in row if t > EOS_ID] for row in targets])
  for row, result in enumerate(scored):
    theirs = np.asarray(result.log_probs)  # Every target token and the EOS.
    assert len(theirs) == int(np.sum(targets[row] > 0))
    np.testing.assert_allclose(theirs, np.asarray(ours)[row, :len(theirs)], atol=1e-4)


def test_int8_model_translates_and_the_cli_reports_errors_in_one_line(trained_run, tmp_path):
  """Into a folder holding a jax export: refused, then with --overwrite only CTranslate2's
  files are left (the two kinds of model are not mixed)."""
  folder = tmp_path / 'int8'
  folder.mkdir()
  for name in ('translator.json', 'translator_8.jax', 'params.npz', 'serving.py'):
    (folder / name).write_text('x')
  command = [sys.executable, 'export.py', '--workdir', trained_run, '--format', 'ctranslate2',
             '--quantization', 'int8', '--output', str(folder)]
  result = subprocess.run(command, cwd=REPO, capture_output=True, timeout=300)
  stderr = result.stderr.decode()
  assert result.returncode == 1 and 'Traceback' not in stderr, stderr
  assert stderr.strip().splitlines()[-1].startswith('error: ') and '--overwrite' in stderr
  result = subprocess.run(command + ['--overwrite'], cwd=REPO, capture_output=True, timeout=300)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  _, tokenizer, model = runs.load_run(trained_run)
  # The run's output layer covers fewer pieces than its vocabulary: two vocabularies.
  assert model.config.num_outputs < tokenizer.vocab_size
  assert sorted(os.listdir(folder)) == ['config.json', 'model.bin', 'source_vocabulary.json',
                                        'target_vocabulary.json', 'tokenizer.model']
  sources, _ = val_sentences(4)
  results = ctranslate2.Translator(str(folder)).translate_batch(pieces(tokenizer, sources),
                                                                 max_decoding_length=20)
  assert len(results) == 4 and all(r.hypotheses[0] for r in results)

  run = tmp_path / 'gelu_run'
  shutil.copytree(trained_run, run)
  saved = json.loads((run / 'config.json').read_text())
  saved['model']['activation'] = 'gelu'
  (run / 'config.json').write_text(json.dumps(saved))
  result = subprocess.run(
      [sys.executable, 'export.py', '--workdir', str(run), '--format', 'ctranslate2',
       '--output', str(tmp_path / 'gelu')], cwd=REPO, capture_output=True, timeout=300)
  stderr = result.stderr.decode()
  assert result.returncode == 1 and 'Traceback' not in stderr, stderr
  last_line = stderr.strip().splitlines()[-1]
  assert last_line.startswith("error: CTranslate2 runs the paper's attention"), stderr
  assert "activation 'gelu'" in last_line, stderr


@pytest.mark.parametrize('pre_norm, fix_norm', [(True, False), (False, False), (True, True)])
def test_scale_norm_runs_export_as_rms_norm_with_our_log_probabilities(pre_norm, fix_norm,
                                                                       tmp_path):
  # A random model whose norms' gains are drawn too (not their initial sqrt(d_model)); with
  # FixNorm its embedding rows' lengths too, which the export must write out as unit rows.
  config = TransformerConfig(vocab_size=24, d_model=16, num_heads=2, d_ff=32,
                             num_encoder_layers=2, num_decoder_layers=2, norm='scale',
                             pre_norm=pre_norm, fix_norm=fix_norm, dropout_rate=0.0)
  model = Transformer(config)
  rng = np.random.default_rng(0)
  sources = [rng.integers(3, 24, n).tolist() for n in (5, 9, 3)]
  targets = [rng.integers(3, 24, n).tolist() for n in (7, 4, 6)]
  width = 10
  pad = lambda rows: np.array([r + [EOS_ID] + [0] * (width - len(r) - 1) for r in rows], np.int32)
  inputs, outputs = pad(sources), pad(targets)
  params = model.init(jax.random.PRNGKey(0), inputs, outputs)['params']
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * rng.uniform(0.5, 2.0) if path[-1].key == 'scale' else x, params)
  if fix_norm:
    params = {**params, 'embed': {'embedding': params['embed']['embedding']
                                  * rng.uniform(0.2, 5.0, (24, 1)).astype(np.float32)}}
  pieces = [f'p{i}' for i in range(24)]
  export.ctranslate2_spec(config, params, pieces).save(str(tmp_path))
  scored = ctranslate2.Translator(str(tmp_path), intra_threads=1).score_batch(
      [[pieces[i] for i in s] for s in sources], [[pieces[i] for i in t] for t in targets])
  logits = model.apply({'params': params}, inputs, outputs)
  ours = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), outputs[..., None],
                            axis=-1)[..., 0]
  for row, target in enumerate(targets):
    theirs = np.asarray(scored[row].log_probs)  # Every target token and the EOS.
    assert len(theirs) == len(target) + 1
    np.testing.assert_allclose(theirs, ours[row, :len(theirs)], atol=1e-4)
