"""Training features around the loop: the parameters' moving average (EMA), keeping the best
checkpoint by a validation metric, and early stopping (resuming with them: test_train.py's
test_resume_equals_uninterrupted_run)."""

import functools

import jax
import numpy as np
import pytest
from test_train import _assert_trees_close, needs_multi30k, random_batch, small_config

import input_pipeline
import train
from model import Transformer, TransformerConfig
from nmt import checkpoints, config_check, evaluation, optimization, sharding, tokenizer


def test_ema_follows_its_formula_step_by_step():
  config = small_config({'optimizer.ema_decay': 0.8, 'model.vocab_size': 40})
  mesh = sharding.make_mesh('')
  model = Transformer(TransformerConfig(**config.model))
  optimizer = optimization.make_optimizer(config)
  init = functools.partial(optimization.init_train_state, model, optimizer, ema=True)
  shardings = sharding.state_shardings(jax.eval_shape(init, jax.random.PRNGKey(0)), mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(0))
  step_fn, batch_sharding = optimization.compile_train_step(config, model, optimizer, mesh,
                                                            shardings)
  expected = jax.device_get(state['params'])
  rng = np.random.default_rng(0)
  for step in range(1, 5):
    batch = random_batch(rng, config.data.batch_size, 12, 40)
    state, _ = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
    rate = min(0.8, (1 + step) / (10 + step))  # The ramp: 0.18, 0.25, 0.31, 0.36 here.
    params = jax.device_get(state['params'])
    expected = jax.tree_util.tree_map(lambda e, p, r=rate: r * e + (1 - r) * p, expected, params)
    _assert_trees_close(jax.device_get(state['ema_params']), expected, atol=1e-6)
  # The average lags the parameters: the check can fail.
  difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
      jax.tree_util.tree_leaves(jax.device_get(state['ema_params'])),
      jax.tree_util.tree_leaves(params)))
  assert difference > 1e-4


@pytest.mark.slow  # R-Drop is in no committed recipe; the fast set is at its time budget.
def test_rdrop_adds_alpha_times_a_positive_divergence_and_nothing_without_dropout():
  rng = np.random.default_rng(3)
  batch = random_batch(rng, 4, 12, 40)
  key = jax.random.PRNGKey(1)

  model_config = lambda rate: TransformerConfig(**small_config(
      {'model.vocab_size': 40, 'model.dropout_rate': rate}).model)
  params = jax.jit(Transformer(model_config(0.0)).init)(  # Dropout does not change them.
      key, batch['inputs'][:1], batch['targets'][:1])['params']

  def loss(dropout_rate, alpha):
    value, sums = jax.jit(functools.partial(
        optimization.training_loss, model=Transformer(model_config(dropout_rate)),
        label_smoothing=0.1, rdrop_alpha=alpha))(params, batch, key)
    return float(value), {k: float(v) for k, v in sums.items()}

  # Without dropout both passes are the plain pass: the same sums, a divergence of 0.
  plain, plain_sums = loss(0.0, 0.0)
  doubled, doubled_sums = loss(0.0, 3.0)
  assert doubled == pytest.approx(plain, rel=1e-5)
  assert doubled_sums == pytest.approx(plain_sums, rel=1e-5)
  # With dropout the passes differ: the added term is positive and linear in alpha (alpha 0
  # runs one pass with other dropout, so the comparisons start from alpha 1).
  one, two, three = (loss(0.3, alpha)[0] for alpha in (1.0, 2.0, 3.0))
  assert two - one > 1e-3 * abs(one)
  assert three - one == pytest.approx(2 * (two - one), rel=1e-3)


def test_training_feature_config_errors():
  mesh = sharding.make_mesh('')
  for change, message in (({'optimizer.ema_decay': 1.0}, 'ema_decay must be in'),
                          ({'eval.keep_best_metric': 'ter'}, 'keep_best_metric must be'),
                          ({'eval.keep_best_metric': 'bleu', 'eval.bleu_sentences': 0},
                           'needs BLEU evaluations'),
                          ({'eval.early_stopping_patience': 3}, 'early_stopping_patience'),
                          ({'eval.early_stopping_patience': -1}, 'early_stopping_patience'),
                          ({'optimizer.cooldown_fraction': 1.5}, 'cooldown_fraction must be in'),
                          ({'optimizer.cooldown_fraction': -0.1}, 'cooldown_fraction must be in'),
                          ({'max_train_minutes': -5.0}, 'max_train_minutes must be'),
                          ({'optimizer.rdrop_alpha': -1.0}, 'rdrop_alpha must be >= 0'),
                          ({'data.target_pieces_first': True, 'data.bpe_dropout': 0.1},
                           'bpe_dropout splits targets into pieces beyond the output layer'),
                          ({'data.target_pieces_first': False, 'model.output_vocab_size': 300},
                           'output_vocab_size is set by train.py'),
                          ({'max_train_minutes': float('inf')}, 'max_train_minutes must be')):
    with pytest.raises(config_check.ConfigError, match=message):
      config_check.validate_config(small_config(change), mesh)


@needs_multi30k
def test_an_output_layer_size_other_than_the_targets_need_is_an_error(tmp_path, one_device):
  """With data.target_pieces_first train.py sizes the output layer; a user's other size is
  refused, naming the size the training targets need, before a model is built."""
  config = small_config({'model.output_vocab_size': 128})
  workdir = tmp_path / 'run'
  with pytest.raises(config_check.ConfigError, match='output_vocab_size=128') as error:
    train.train_and_evaluate(config, str(workdir))
  trained = tokenizer.load_tokenizer(str(workdir / 'tokenizer.model'))
  needed = input_pipeline.output_vocab_size(config, trained)
  assert needed != 128 and f'need {needed} ' in str(error.value)
  assert not (workdir / 'checkpoints').exists()


@needs_multi30k
def test_early_stop_after_patience_evaluations_is_reproducible(tmp_path, monkeypatch,
                                                                 one_device):
  """Validation losses rigged to improve until step 4, then get worse: with patience 2 and an
  evaluation every 2 steps, training stops at step 8, best at step 4; a rerun stays stopped."""
  losses = {2: 3.0, 4: 2.5, 6: 2.6, 8: 2.55, 10: 2.0}
  real_loss = evaluation.Evaluator.loss
  steps_seen = []

  def rigged(self, params):
    self.batches = self.batches[:1]
    metrics = real_loss(self, params)
    steps_seen.append(len(steps_seen) * 2 + 2)
    return dict(metrics, eval_nll=losses[steps_seen[-1]])

  monkeypatch.setattr(evaluation.Evaluator, 'loss', rigged)
  config = small_config({'num_train_steps': 20, 'checkpoint_every_steps': 4,
                         'eval.every_steps': 2, 'eval.bleu_sentences': 0,
                         'eval.keep_best_metric': 'loss', 'eval.early_stopping_patience': 2})
  workdir = tmp_path / 'run'
  result = train.train_and_evaluate(config, str(workdir))
  assert result['early_stopped'] and result['step'] == 8
  assert result['best'] == {'value': 2.5, 'step': 4, 'stale': 2}
  assert checkpoints.saved_steps(str(workdir))[-1] == 8
  best, origin = checkpoints.load_params(str(workdir), 'best')
  assert 'step 4' in origin
  _assert_trees_close(jax.device_get(best), jax.device_get(
      checkpoints.restore_params(str(workdir), 4)), atol=0)
  again = train.train_and_evaluate(config, str(workdir))
  assert again['early_stopped'] and again['step'] == 8 and len(steps_seen) == 4


def test_named_checkpoints_missing_are_clear_errors(tmp_path):
  (tmp_path / 'checkpoints' / '4').mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='train with eval.keep_best_metric'):
    checkpoints.load_params(str(tmp_path), 'best')
  with pytest.raises(FileNotFoundError, match='optimizer.ema_decay'):
    checkpoints.load_params(str(tmp_path), 'ema')
  with pytest.raises(ValueError, match="one of \\['averaged', 'best', 'ema'\\]"):
    checkpoints.load_params(str(tmp_path), 'newest')
