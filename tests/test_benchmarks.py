"""Smoke tests of the benchmarks (train step, input pipeline, matmul peak, plots) on tiny inputs."""

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest

import input_pipeline as ip
from benchmarks import input_pipeline as input_pipeline_benchmark
from benchmarks import matmul_peak, plot_curves
from benchmarks import train_step as train_step_benchmark

TINY = ['--steps', '2', '--repeats', '1', '--warmup', '1', '--vocab', '64', '--d-model', '16',
        '--d-ff', '32', '--heads', '2', '--layers', '1', '--batch', '8', '--length', '8',
        '--peak-size', '128', '--peak-runs', '2']


@pytest.mark.slow  # About 30 s; the benchmark's config shape is checked in the fast set below.
def test_train_step_benchmark_writes_positive_numbers(tmp_path):
  out = tmp_path / 'step.json'
  train_step_benchmark.main(TINY + ['--json', str(out), '--breakdown'])
  results = json.loads(out.read_text())
  for key in ('target_tokens_per_s', 'seconds_per_step', 'first_step_s', 'xla_gflop_per_step',
              'model_gflop_per_step', 'achieved_gflops_xla', 'achieved_gflops_model',
              'matmul_peak_gflops', 'mfu_xla', 'mfu_model'):
    assert results[key] > 0, key
  assert results['target_tokens_per_step'] == 8 * 8  # Every target is a real token.
  assert results['normalised_vs_peer']['tokens_per_s_per_peak_ratio'] > 0
  assert {'cpu', 'cores', 'jax'} <= set(results['machine'])
  assert {'forward', 'forward_backward', 'optimizer', 'full_step'} <= set(results['breakdown'])


def test_train_step_benchmark_config_has_the_requested_shape():
  config = train_step_benchmark.make_config(train_step_benchmark.parse_args(
      TINY + ['--dtype', 'bfloat16', '--dropout', '0', '--pre-norm', '--norm', 'scale',
              '--fix-norm', '--weight-decay', '0.1']))
  assert (config.model.vocab_size, config.model.d_model, config.model.d_ff,
          config.model.num_heads) == (64, 16, 32, 2)
  assert config.model.num_encoder_layers == config.model.num_decoder_layers == 1
  assert config.model.dtype == 'bfloat16' and config.model.dropout_rate == 0
  assert config.model.pre_norm and config.model.norm == 'scale' and config.model.fix_norm
  assert (config.data.batch_size, config.data.max_length) == (8, 8)
  assert config.optimizer.label_smoothing == 0.1 and config.optimizer.grad_accum_steps == 1
  assert config.optimizer.weight_decay == 0.1
  assert train_step_benchmark.make_config(
      train_step_benchmark.parse_args(TINY)).optimizer.weight_decay == 0.0
  # The benchmark times the one shared definition of the peak.
  assert train_step_benchmark.matmul_peak_gflops is matmul_peak.matmul_peak_gflops


def test_matmul_peak_is_positive():
  assert matmul_peak.matmul_peak_gflops(size=64, repeats=2) > 0
  with pytest.raises(ValueError, match='positive'):
    matmul_peak.matmul_peak_gflops(size=64, repeats=0)


def test_analytic_flops_match_hand_count():
  """One 1+1-layer model: 6 * kernels * tokens + attention + output projection."""
  args = train_step_benchmark.parse_args(TINY)
  built = train_step_benchmark.build(args)
  flops = train_step_benchmark.analytic_flops(
      built['state']['params'], built['config'].model, batch=8, source_len=8, target_len=8)
  d, ff, vocab, tokens = 16, 32, 64, 64
  encoder, decoder = 4 * d * d + 2 * d * ff, 8 * d * d + 2 * d * ff
  assert flops['params_nonembedding_kernels'] == encoder + decoder
  assert flops['dense_nonembedding'] == 6 * (encoder + decoder) * tokens
  assert flops['attention'] == 12 * d * 8 * (8 * 8 + 8 * 8 + 8 * 8)
  assert flops['output_projection'] == 6 * d * vocab * tokens
  smaller = train_step_benchmark.make_config(train_step_benchmark.parse_args(
      TINY + ['--output-vocab', '48']))
  assert smaller.model.output_vocab_size == 48
  assert train_step_benchmark.analytic_flops(
      built['state']['params'], smaller.model, batch=8, source_len=8,
      target_len=8)['output_projection'] == 6 * d * 48 * tokens


needs_multi30k = pytest.mark.skipif(
    not (Path(os.environ.get(ip.MULTI30K_ENV, '/nonexistent')) / 'train.en').is_file(),
    reason='Multi30k test data not found ($MULTI30K_DIR)')


@needs_multi30k
def test_input_pipeline_benchmark_runs(tmp_path):
  out = tmp_path / 'input.json'
  results = input_pipeline_benchmark.main(['--workdir', str(tmp_path / 'work'), '--batches', '5',
                                           '--warmup', '1', '--json', str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(results))
  assert (results['batch_size'], results['max_length'], results['vocab_size'],
          results['num_shards'], results['pairs']) == (32, 64, 10000, 4, 29000)
  (run,) = results['runs']['1']
  assert run['batches_per_second'] > 0 and run['target_tokens_per_cpu_second'] > 0
  assert 0.85 <= run['packing_efficiency'] <= 1 and run['shards'] == [0, 3]
  assert 0 < run['first_batch_seconds'] < run['process_to_first_batch_seconds']
  assert run['resume_matches'] and 0 < run['resume_seconds'] < 60
  assert run['peak_rss_mb'] > 0 and run['resume_peak_rss_mb'] > 0


@pytest.mark.slow  # The benchmark's other mode; the fast set runs it on Multi30k, one process.
@needs_multi30k
def test_input_pipeline_benchmark_on_a_synthetic_corpus_with_two_processes(tmp_path):
  out = tmp_path / 'input.json'
  results = input_pipeline_benchmark.main([
      '--workdir', str(tmp_path), '--synthetic_pairs', '1500', '--processes', '2',
      '--vocab_size', '500', '--batches', '3', '--warmup', '1', '--json', str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(results))
  lines = (tmp_path / 'synthetic_1500' / 'train.de').read_text().splitlines()
  assert len(lines) == 1500 and (results['num_shards'], results['batch_size']) == (64, 192)
  workers = results['runs']['2']
  assert [w['shards'] for w in workers] == [[0, 31], [32, 63]]
  assert all(w['resume_matches'] and w['peak_rss_mb'] > 0 for w in workers)


def _write_metrics(path, lines):
  path.write_text(''.join(json.dumps(line) + '\n' for line in lines))


def test_plot_curves_merges_steps_and_writes_png(tmp_path):
  lines = [{'step': 0, 'num_params': 123}]
  for step in range(10, 101, 10):
    lines.append({'step': step, 'train_loss': 5.0 - step / 50, 'train_nll': 4.0 - step / 50,
                  'seconds_per_step': 0.5})
    if step % 50 == 0:
      lines.append({'step': step, 'eval_nll': 4.5 - step / 50, 'eval_bleu': step / 10.0,
                    'eval_chrf': step / 5.0})
  lines.append({'step': 50, 'train_loss': 1.25, 'seconds_per_step': 0.5})  # A resumed run.
  _write_metrics(tmp_path / 'metrics.jsonl', lines)
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 110, "train_lo')  # A line being written right now.

  records = plot_curves.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert records[50]['train_loss'] == 1.25  # The last value of a repeated step wins...
  assert records[50]['eval_bleu'] == 5.0  # ...and lines of one step are merged.
  steps, minutes = plot_curves.minutes_at(records)
  assert minutes[-1] == pytest.approx(100 * 0.5 / 60)

  path = plot_curves.main(['--workdir', str(tmp_path)])
  assert path == str(tmp_path / 'curves.png')
  data = (tmp_path / 'curves.png').read_bytes()
  assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 20_000


def test_plot_curves_uses_train_minutes_and_compares_runs(tmp_path):
  for run, speed in (('a', 1.0), ('b', 2.0)):
    os.makedirs(tmp_path / run)
    _write_metrics(tmp_path / run / 'metrics.jsonl', [
        {'step': 10, 'train_loss': 3.0, 'train_minutes': 1.0 / speed},
        {'step': 20, 'train_loss': 2.0, 'train_minutes': 2.0 / speed},
        {'step': 20, 'eval_bleu': 5.0 * speed, 'train_minutes': 2.0 / speed},
        {'step': 30, 'train_loss': 1.0, 'train_minutes': 3.0 / speed},
        {'step': 30, 'eval_bleu': 9.0 * speed, 'train_minutes': 3.0 / speed}])
  records = plot_curves.read_metrics(str(tmp_path / 'b' / 'metrics.jsonl'))
  steps, minutes = plot_curves.minutes_at(records)
  assert list(steps) == [0, 10, 20, 30] and list(minutes) == [0.0, 0.5, 1.0, 1.5]
  minutes, bleu = plot_curves.score_against_minutes(records)
  assert list(minutes) == [1.0, 1.5] and list(bleu) == [10.0, 18.0]
  plot_curves.main(['--workdir', str(tmp_path / 'a'), '--output', str(tmp_path / 'o' / 'c.png')])
  assert (tmp_path / 'o' / 'c.png').stat().st_size > 10_000
  path = plot_curves.main(['--compare', str(tmp_path / 'a'), str(tmp_path / 'b'), '--output',
                           str(tmp_path / 'o' / 'bleu.png')])
  assert open(path, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
  with pytest.raises(SystemExit, match='no eval_chrf'):
    plot_curves.main(['--compare', str(tmp_path / 'a'), '--key', 'eval_chrf', '--output',
                      str(tmp_path / 'x.png')])


def test_plot_curves_errors_clearly(tmp_path):
  with pytest.raises(SystemExit, match='does not exist'):
    plot_curves.main(['--workdir', str(tmp_path)])
  (tmp_path / 'metrics.jsonl').write_text('')
  with pytest.raises(SystemExit, match='no metrics yet'):
    plot_curves.main(['--workdir', str(tmp_path)])
  _write_metrics(tmp_path / 'metrics.jsonl', [{'step': 0, 'num_params': 5}])
  with pytest.raises(SystemExit, match='nothing|no train_loss'):
    plot_curves.main(['--workdir', str(tmp_path)])


def test_attention_comparison_commands_and_report(tmp_path, capsys):
  from benchmarks import attention_comparison as comparison
  command = comparison.train_command('rnn_luong', str(tmp_path / 'rnn_luong'), 20)
  assert 'configs/multi30k_rnn.py' in ' '.join(command)
  assert '--config.model.attention_score=general' in command
  assert '--config.max_train_minutes=20' in command
  # Every variant's command sets only keys its config has (train.py rejects any other).
  for variant, (config_file, _, _) in comparison.VARIANTS.items():
    module = importlib.import_module(config_file[:-len('.py')].replace('/', '.'))
    config = module.get_config()
    for arg in comparison.train_command(variant, str(tmp_path / variant), 20):
      if arg.startswith('--config.'):
        *groups, key = arg[len('--config.'):].split('=')[0].split('.')
        node = config
        for group in groups:
          node = node[group]
        assert key in node, (variant, arg)
  with pytest.raises(SystemExit, match='no .*comparison.json yet'):
    comparison.report(str(tmp_path), None, None)
  for variant, bleu in (('transformer_softmax', 30.0), ('rnn_luong', 20.0)):
    run = tmp_path / variant
    os.makedirs(run)
    _write_metrics(run / 'metrics.jsonl', [
        {'step': 0, 'num_params': 7_500_000},
        {'step': 50, 'train_loss': 3.0, 'target_tokens_per_second': 100.0, 'train_minutes': 0.5},
        {'step': 100, 'train_loss': 2.0, 'target_tokens_per_second': 4000.0,
         'train_minutes': 1.0},
        {'step': 100, 'eval_bleu': bleu / 2, 'train_minutes': 1.0},
        {'step': 150, 'train_loss': 1.0, 'target_tokens_per_second': 5000.0,
         'train_minutes': 1.5},
        {'step': 150, 'eval_bleu': bleu, 'train_minutes': 1.5}])
    summary = comparison.training_summary(str(run))
    # The first interval (compiling) is left out of the speed.
    assert summary == {'params': 7_500_000, 'steps': 150, 'train_minutes': 1.5,
                       'train_target_tokens_per_s': 4500.0}
    result = dict(summary, variant=variant, what=comparison.VARIANTS[variant][2],
                  budget_minutes=1.5, sentences=1000, bleu=bleu, bleu_lowercase=bleu + 0.3,
                  chrf=50.0, decode_first_call_s=20.0, decode_sentences_per_s=80.0)
    (run / 'comparison.json').write_text(json.dumps(result))
  rows = comparison.report(str(tmp_path), str(tmp_path / 'all.json'), str(tmp_path / 'p.png'))
  table = capsys.readouterr().out
  assert [r['variant'] for r in rows] == ['transformer_softmax', 'rnn_luong']
  assert '| Transformer, softmax (the paper) | 7.5M | 150 | 4,500 | 30.00 | 30.30 | 50.00 | ' \
         '80.0 (50.0) |' in table
  assert json.loads((tmp_path / 'all.json').read_text()) == rows
  assert (tmp_path / 'p.png').read_bytes()[:4] == b'\x89PNG'


def test_time_to_quality_thresholds_and_plot(tmp_path, monkeypatch):
  from benchmarks import plot_curves, time_to_quality
  points = [{'step': s, 'minutes': s / 100, 'bleu': b, 'bleu_tok_lc': b + 0.4}
            for s, b in ((500, 20.0), (1000, 31.0), (1500, 29.0), (2000, 35.5))]
  assert time_to_quality.first_reaching(points, 30.0) == 10.0
  assert time_to_quality.first_reaching(points, 35.0) == 20.0
  assert time_to_quality.first_reaching(points, 42.0) is None
  # A fixed rate places the checkpoints without reading the run's logged minutes.
  assert time_to_quality.minutes_of_steps(str(tmp_path / 'absent'), [1000, 2500],
                                          seconds_per_step=0.3) == pytest.approx([5.0, 12.5])
  path = tmp_path / 'run.json'
  path.write_text(json.dumps({'workdir': '/x/run', 'split': 'test_2016_flickr',
                              'points': points}))
  time_to_quality.main(['--plot', str(tmp_path / 'ttq.png'), str(path)])
  assert (tmp_path / 'ttq.png').read_bytes()[:4] == b'\x89PNG'
  # The papers' metric, with the published result as a line (and without the peer's sacreBLEU).
  drawn = []
  monkeypatch.setattr(plot_curves, 'plot_runs', lambda curves, output, ylabel, title, points,
                      levels: drawn.append((curves, ylabel, points, levels)) or output)
  time_to_quality.main(['--plot', str(tmp_path / 'tok.png'), '--metric', 'bleu_tok_lc',
                        str(path)])
  (curves, ylabel, points, levels), = drawn
  assert list(curves['run'][1]) == pytest.approx([20.4, 31.4, 29.4, 35.9])
  assert 'tok-lc' in ylabel and points is None and list(levels.values()) == [41.02]
  with pytest.raises(SystemExit):
    time_to_quality.main(['--plot', str(tmp_path / 'x.png'), '--labels', 'a,b', str(path)])


@pytest.mark.slow
def test_time_to_quality_scores_every_checkpoint(trained_run):
  from benchmarks import time_to_quality
  result = time_to_quality.measure(trained_run, 'val', every_steps=200)
  assert [p['step'] for p in result['points']] == [200, 300]
  minutes = [p['minutes'] for p in result['points']]
  assert 0 < minutes[0] < minutes[1]
  assert 'average of steps [200, 300]' in result['averaged']['checkpoint']


@pytest.mark.slow  # Trains a run (about 20 s); the curve's arithmetic is in the fast set.
def test_time_to_quality_moving_average_reads_each_checkpoints_average(tmp_path, monkeypatch,
                                                                       one_device):
  """--moving_average scores each checkpoint's moving average (not its parameters) and the
  newest one in place of the last checkpoints' mean."""
  import jax
  import numpy as np
  from conftest import needs_multi30k
  from test_train import small_config

  import train
  from benchmarks import time_to_quality
  from nmt import checkpoints
  needs_multi30k()
  config = small_config({'optimizer.ema_decay': 0.9, 'num_train_steps': 6,
                         'checkpoint_every_steps': 3, 'eval.every_steps': 1000,
                         'eval.bleu_sentences': 0})
  run = str(tmp_path / 'run')
  train.train_and_evaluate(config, run)
  sources = ['A dog runs.', 'Two men walk on the beach.']
  monkeypatch.setattr(ip, 'read_split', lambda config, split: (sources, sources))
  seen = []

  class Recording:  # Records which parameters each translation used; echoes the sources.
    def __init__(self, *args, alpha=None, **kwargs):
      alphas.append(alpha)

    def __call__(self, params, texts):
      seen.append(jax.device_get(params))
      return list(texts)

  alphas = []
  monkeypatch.setattr(time_to_quality.translator_lib, 'Translator', Recording)
  result = time_to_quality.measure(run, 'val', moving_average=True, alpha=1.7)
  assert alphas == [1.7] and result['alpha'] == 1.7  # --alpha reaches the beam search.
  assert [p['step'] for p in result['points']] == [3, 6] and result['moving_average']
  assert result['points'][0]['bleu'] == pytest.approx(100.0)  # The echo scores itself.
  assert 'moving average at step 6' in result['averaged']['checkpoint']

  def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for step, used in zip((3, 6, 6), seen):
    saved = checkpoints.read_checkpoint(checkpoints.step_path(run, step),
                                        {'ema': device, 'params': device})
    for a, b in zip(leaves(used), leaves(saved['ema'])):
      np.testing.assert_array_equal(a, b)
    assert any(not np.allclose(a, r) for a, r in zip(leaves(used), leaves(saved['params'])))
  without = tmp_path / 'without'  # The same run as if trained without a moving average.
  shutil.copytree(run, without)
  for step in (3, 6):
    shutil.rmtree(Path(checkpoints.step_path(str(without), step)) / 'ema')
  with pytest.raises(SystemExit, match='drop --moving_average'):
    time_to_quality.measure(str(without), 'val', moving_average=True)


def test_decode_batches_accounts_for_every_sentence_and_its_idle_rows(tmp_path):
  from benchmarks import decode_batches
  source = tmp_path / 'source.txt'
  source.write_text('A dog runs.\n\nTwo men are walking along a long sandy beach at sunset.\n'
                    'A girl.\n', encoding='utf-8')
  run = Path(__file__).parent / 'data' / 'legacy_run'
  report = decode_batches.measure(str(run), str(source), repeats=1)
  assert report['sentences'] == 3  # The empty line is not decoded.
  assert sum(row['sentences'] for row in report['batches']) == 3
  for row in report['batches']:
    rows = int(row['shape'].split('x')[0])
    assert 1 <= row['mean_output'] <= row['longest_output']
    # Busy row-steps: the outputs' total length over rows x longest, padding rows idle.
    assert 0 < row['busy_fraction'] <= row['sentences'] / rows
  assert 0 < report['busy_fraction'] <= 1 and report['compile_seconds']
  continuous = report['continuous']
  assert continuous['same_translations_as_batches'] and continuous['pass_seconds'] > 0
