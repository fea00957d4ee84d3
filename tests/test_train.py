"""Training: schedule, loss, multi-device and accumulation equivalence, resume, signals, faults."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import input_pipeline
import train
from configs import tiny
from model import Transformer, TransformerConfig
from nmt import (
    batching,
    checkpoints,
    config_check,
    evaluation,
    loop_control,
    metrics,
    optimization,
    sharding,
)

MULTI30K = os.environ.get('MULTI30K_DIR', '')
needs_multi30k = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MULTI30K, 'train.en')),
    reason='needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these machines)')


def small_config(overrides: dict | None = None):
  """configs/tiny.py without dropout, with {'group.key': value} overrides."""
  config = tiny.get_config()
  config.model.dropout_rate = 0.0
  for path, value in (overrides or {}).items():
    *groups, key = path.split('.')
    node = config
    for group in groups:
      node = node[group]
    node[key] = value
  return config


def random_batch(rng, rows, length, vocab, packed=True):
  """A packed batch: two segments per row of random lengths, then padding."""
  batch = {k: np.zeros((rows, length), np.int32) for k in input_pipeline.FEATURE_KEYS}
  for row in range(rows):
    for side in ('inputs', 'targets'):
      first, second = rng.integers(2, length // 2, size=2) if packed else (length - 3, 0)
      position = 0
      for segment, size in ((1, first), (2, second)):
        if size == 0:
          continue
        tokens = rng.integers(3, vocab, size)
        tokens[-1] = 1
        batch[side][row, position:position + size] = tokens
        batch[f'{side}_segmentation'][row, position:position + size] = segment
        batch[f'{side}_positions'][row, position:position + size] = np.arange(size)
        position += size
  return batch


def test_schedule_matches_the_paper_formula():
  config = small_config({'model.d_model': 512, 'optimizer.warmup_steps': 4000,
                         'optimizer.learning_rate_scale': 1.0})
  schedule = optimization.learning_rate_schedule(config)
  for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-5)
  # Peak at the end of warmup, then decay.
  assert float(schedule(3999)) > float(schedule(2000))
  assert float(schedule(3999)) > float(schedule(8000))
  config.optimizer.learning_rate_scale = 2.0
  assert float(optimization.learning_rate_schedule(config)(99)) == pytest.approx(
      2 * 512**-0.5 * 100 * 4000**-1.5, rel=1e-5)


def test_cooldown_ramps_the_paper_rate_down_to_zero_at_the_last_step():
  config = small_config({'model.d_model': 256, 'optimizer.warmup_steps': 100,
                         'num_train_steps': 1000, 'optimizer.cooldown_fraction': 0.4})
  schedule = optimization.learning_rate_schedule(config)
  config.optimizer.cooldown_fraction = 0.0
  paper = optimization.learning_rate_schedule(config)
  for count in (0, 50, 99, 300, 599):  # Steps 1..600: the paper's rate.
    assert float(schedule(count)) == pytest.approx(float(paper(count)), rel=1e-6)
  for step in (601, 700, 800, 999, 1000):  # Then the factor (1001 - step) / 400.
    expected = float(paper(step - 1)) * (1001 - step) / 400
    assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-5)
  assert float(schedule(999)) > 0 and float(schedule(1000)) == 0.0
  assert all(float(schedule(c)) > float(schedule(c + 1)) for c in range(600, 999, 37))


def test_a_run_shortened_on_the_command_line_keeps_its_cooldown_share():
  """A cooldown is a share of the run: --config.num_train_steps=60 alone gives a valid config
  whose last 15 steps cool down (configs/multi30k_rnn.py cools over the last quarter)."""
  from configs import multi30k, multi30k_rnn
  config = multi30k.get_config()
  config.num_train_steps = 60
  config_check.validate_config(config, sharding.make_mesh())
  assert optimization.cooldown_steps(config) == 0  # The recipe decays to the end.
  config = multi30k_rnn.get_config()
  config.num_train_steps = 60
  config_check.validate_config(config, sharding.make_mesh())
  assert optimization.cooldown_steps(config) == 15
  rates = [float(rate) for rate in optimization.learning_rate_schedule(config)(jnp.arange(61))]
  # Steps 1..46 (counts 0..45) still warm up (the recipe's warmup is longer than 60 steps);
  # the last 15 scale the rate down linearly, to 0 after the run.
  assert all(rates[c] < rates[c + 1] for c in range(45))
  assert all(rates[c] > rates[c + 1] for c in range(45, 60))
  assert rates[59] > 0 == rates[60]
  config.optimizer.cooldown_steps = 500  # A config written for the steps-based option.
  with pytest.raises(config_check.ConfigError, match='now optimizer.cooldown_fraction'):
    config_check.validate_config(config, sharding.make_mesh())


def test_optimizer_clips_before_adam_and_decays_only_matrices():
  config = small_config({'model.d_model': 64, 'optimizer.warmup_steps': 10,
                         'optimizer.learning_rate_scale': 1.0, 'optimizer.grad_clip_norm': 1.0,
                         'optimizer.weight_decay': 0.0})
  rng = np.random.default_rng(0)
  params = {'dense': {'kernel': rng.normal(size=(4, 3)), 'bias': rng.normal(size=3)},
            'norm': {'scale': rng.normal(size=3)}}
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
  # A huge first gradient, then a small one: clipping changes Adam's moments (their ratio).
  gradients = [jax.tree_util.tree_map(lambda x, s=s: s * jnp.asarray(
      rng.normal(size=x.shape), jnp.float32), params) for s in (300.0, 0.01)]
  optimizer = optimization.make_optimizer(config)
  opt_state = optimizer.init(params)
  schedule = optimization.learning_rate_schedule(config)
  m = v = jax.tree_util.tree_map(np.zeros_like, params)
  for t, grads in enumerate(gradients, start=1):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    # Adam by hand on the clipped gradient.
    norm = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree_util.tree_leaves(grads)))
    clipped = jax.tree_util.tree_map(lambda g, n=norm: np.asarray(g) * min(1.0, 1.0 / n), grads)
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, clipped)
    v = jax.tree_util.tree_map(lambda v, g: 0.98 * v + 0.02 * g * g, v, clipped)
    expected = jax.tree_util.tree_map(
        lambda m, v, t=t: -float(schedule(t - 1)) * (m / (1 - 0.9**t))
        / (np.sqrt(v / (1 - 0.98**t)) + 1e-9), m, v)
    _assert_trees_close(updates, expected, atol=1e-6)
  # Weight decay: with zero gradients Adam's step is zero, leaving -lr * decay * param on
  # matrices and nothing on biases and LayerNorm scales.
  config = small_config({'model.d_model': 64, 'optimizer.warmup_steps': 10,
                         'optimizer.learning_rate_scale': 1.0, 'optimizer.weight_decay': 0.1})
  optimizer = optimization.make_optimizer(config)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  updates, _ = optimizer.update(zeros, optimizer.init(params), params)
  lr = float(optimization.learning_rate_schedule(config)(0))
  np.testing.assert_allclose(updates['dense']['kernel'], -lr * 0.1 * params['dense']['kernel'],
                             rtol=1e-5)
  np.testing.assert_array_equal(updates['dense']['bias'], 0.0)
  np.testing.assert_array_equal(updates['norm']['scale'], 0.0)


def test_bfloat16_step_keeps_float32_state_and_matches_float32():
  batch = random_batch(np.random.default_rng(5), 16, 24, 40)
  results = {}
  for dtype in ('float32', 'bfloat16'):
    config = small_config({'model.dtype': dtype})
    state, step_fn, batch_sharding = _setup(config, jax.devices()[:1])
    state, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
    results[dtype] = (jax.device_get(state), float(metrics['loss']) / float(metrics['tokens']))
  state16, loss16 = results['bfloat16']
  for leaf in jax.tree_util.tree_leaves((state16['params'], state16['opt_state'])):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  # bfloat16 keeps 8 bits of mantissa: the loss agrees to about 1%.
  assert loss16 == pytest.approx(results['float32'][1], rel=2e-2)
  assert int(state16['nonfinite_total']) == 0


def test_label_smoothed_loss_matches_explicit_smoothed_targets():
  rng = np.random.default_rng(0)
  vocab, smoothing = 11, 0.1
  logits = rng.normal(size=(2, 5, vocab)).astype(np.float32) * 3
  targets = rng.integers(3, vocab, (2, 5))
  targets[0, :3] = logits[0, :3].argmax(-1)  # Some correct predictions for the accuracy count.
  weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
  sums = optimization.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights),
                             smoothing)
  log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float64) if jax.config.x64_enabled
                                 else jnp.asarray(logits))
  soft = np.full((2, 5, vocab), smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1 - smoothing, axis=-1)
  entropy = -(soft * np.log(soft)).sum(-1)
  expected = ((-(soft * np.asarray(log_probs)).sum(-1) - entropy) * weights).sum()
  np.testing.assert_allclose(float(sums['loss']), expected, rtol=1e-5)
  nll = -np.take_along_axis(np.asarray(log_probs), targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(sums['nll']), (nll * weights).sum(), rtol=1e-5)
  assert float(sums['tokens']) == weights.sum()
  correct = (logits.argmax(-1) == targets) * weights
  assert correct.sum() > 0 and float(sums['correct']) == correct.sum()


def _setup(config, devices, vocab=40):
  config.model.vocab_size = vocab
  mesh = sharding.make_mesh(config.mesh_shape, devices)
  model = Transformer(TransformerConfig(**config.model))
  optimizer = optimization.make_optimizer(config)
  init = jax.tree_util.Partial(optimization.init_train_state, model, optimizer)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = sharding.state_shardings(abstract, mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(0))
  step_fn, batch_sharding = optimization.compile_train_step(config, model, optimizer, mesh,
                                                            shardings)
  return state, step_fn, batch_sharding


def _run_steps(config, devices, batches):
  state, step_fn, batch_sharding = _setup(config, devices)
  losses = []
  for batch in batches:
    state, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
    losses.append(float(metrics['loss']) / float(metrics['tokens']))
  return jax.device_get(state['params']), losses


def _assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_loss_falls_near_zero_on_a_copy_task():
  config = small_config({'model.d_model': 64, 'model.d_ff': 128, 'model.num_heads': 4,
                         'optimizer.warmup_steps': 50, 'optimizer.learning_rate_scale': 0.5,
                         'optimizer.label_smoothing': 0.0})
  state, step_fn, batch_sharding = _setup(config, jax.devices()[:1], vocab=16)
  rng = np.random.default_rng(0)
  positions = np.broadcast_to(np.arange(8, dtype=np.int32), (32, 8))
  nll, accuracy = [], []
  for _ in range(400):
    tokens = rng.integers(3, 16, (32, 8)).astype(np.int32)
    tokens[:, -1] = 1
    ones = np.ones_like(tokens)
    batch = {'inputs': tokens, 'targets': tokens, 'inputs_segmentation': ones,
             'targets_segmentation': ones, 'inputs_positions': positions,
             'targets_positions': positions}
    state, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
    nll.append(float(metrics['nll']) / float(metrics['tokens']))
    accuracy.append(float(metrics['correct']) / float(metrics['tokens']))
  assert nll[0] > 2.0  # Starts near log(13): the task is not trivially solved.
  assert np.mean(nll[-20:]) < 0.1, f'copy task NLL {np.mean(nll[-20:]):.3f} after 400 steps'
  assert np.mean(accuracy[-20:]) > 0.97


@pytest.mark.parametrize('mesh_shape', [  # The fast set runs the mesh with both axes.
    pytest.param('data:8', marks=pytest.mark.slow), 'data:4,fsdp:2',
    pytest.param('data:1,fsdp:8', marks=pytest.mark.slow)])
def test_eight_devices_match_one_device(mesh_shape, monkeypatch):
  monkeypatch.setattr(sharding, 'FSDP_MIN_SIZE', 1)  # The tiny model's arrays split too.
  assert len(jax.devices()) >= 8, 'conftest sets 8 fake CPU devices'
  rng = np.random.default_rng(1)
  batches = [random_batch(rng, 16, 24, 40) for _ in range(3)]
  # With dropout: its masks must not depend on how the batch is split over devices.
  one_params, one_losses = _run_steps(small_config({'model.dropout_rate': 0.1}),
                                      jax.devices()[:1], batches)
  eight_params, eight_losses = _run_steps(
      small_config({'model.dropout_rate': 0.1, 'mesh_shape': mesh_shape}), jax.devices()[:8],
      batches)
  np.testing.assert_allclose(one_losses, eight_losses, rtol=1e-5)
  # Adam divides each gradient entry by its own magnitude, so float32 reduction-order noise in
  # near-zero entries reaches ~1e-6 in the parameters; real updates here are ~1e-2.
  _assert_trees_close(one_params, eight_params, atol=1e-5)
  # The updates are not trivially zero: parameters moved.
  state0, _, _ = _setup(small_config(), jax.devices()[:1])
  moved = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree_util.tree_leaves(jax.device_get(state0['params'])),
      jax.tree_util.tree_leaves(one_params)))
  assert moved > 1e-3


def test_fsdp_shards_parameters(monkeypatch):
  monkeypatch.setattr(sharding, 'FSDP_MIN_SIZE', 1)
  config = small_config({'mesh_shape': 'data:4,fsdp:2'})
  state, _, _ = _setup(config, jax.devices()[:8])
  specs = {str(x.sharding.spec) for x in jax.tree_util.tree_leaves(state['params'])}
  assert any('fsdp' in spec for spec in specs), specs


def test_fsdp_shards_only_large_arrays():
  """Biases, LayerNorm scales and PRNG keys stay whole: splitting them saves little memory
  and costs an all-gather each (earlier code split a [2] PRNG key and every bias)."""
  assert sharding.parameter_spec((2,), 2) == P()  # A PRNG key's data.
  assert sharding.parameter_spec((2048,), 2) == P()  # A base model's feed-forward bias.
  assert sharding.parameter_spec((512, 2048), 2) == P(None, 'fsdp')
  assert sharding.parameter_spec((37000, 512), 4) == P('fsdp', None)
  assert sharding.parameter_spec((511, 509), 2) == P()  # Nothing the axis divides.
  assert sharding.parameter_spec((512, 2048), 1) == P()


def test_gradient_accumulation_equals_one_big_batch():
  rng = np.random.default_rng(2)
  batches = [random_batch(rng, 16, 24, 40) for _ in range(3)]
  big_params, big_losses = _run_steps(small_config(), jax.devices()[:2], batches)
  accum_params, accum_losses = _run_steps(small_config({'optimizer.grad_accum_steps': 4}),
                                          jax.devices()[:2], batches)
  np.testing.assert_allclose(big_losses, accum_losses, rtol=1e-5)
  # Parameters move by up to ~7e-2 here. Summing the gradient in four parts rounds
  # differently, and Adam scales an entry whose gradient is near zero up to a full-size step,
  # so single entries can differ by a few 1e-5 (one here: 2.3e-5, 0.1% of its move); the rest
  # agree to ~1e-6. Weighting one micro-batch 10% too much moves entries by ~2e-3 (checked).
  _assert_trees_close(big_params, accum_params, atol=5e-5)


def test_nonfinite_update_is_skipped_and_counted():
  config = small_config()
  state, step_fn, batch_sharding = _setup(config, jax.devices()[:1])
  before = jax.device_get(state['params'])
  batch = random_batch(np.random.default_rng(3), 16, 24, 40)
  poisoned = jax.tree_util.tree_map(lambda x: x, state)
  # A NaN in one embedding row poisons the loss of every batch that uses it.
  poisoned['params']['embed']['embedding'] = state['params']['embed']['embedding'].at[5].set(
      jnp.nan)
  batch['targets'][0, 0] = 5
  new_state, metrics = step_fn(poisoned, sharding.from_host_rows(batch, batch_sharding))
  assert not bool(metrics['finite'])
  assert int(new_state['nonfinite_in_a_row']) == 1 and int(new_state['nonfinite_total']) == 1
  after = jax.device_get(new_state['params'])
  # Everything but the poisoned row is unchanged: the update was skipped.
  np.testing.assert_array_equal(np.delete(after['embed']['embedding'], 5, 0),
                                np.delete(before['embed']['embedding'], 5, 0))


def test_learning_rate_follows_the_step_through_skipped_updates():
  """A skipped update still advances the schedule: the next update uses (and logs) the rate of
  its own step. Before, optax's count stood still on a skip and the logged rate was not the
  applied one."""
  config = small_config({'optimizer.weight_decay': 0.0})  # Adam's step alone, measured below.
  state, step_fn, batch_sharding = _setup(config, jax.devices()[:1])
  schedule = optimization.learning_rate_schedule(config)
  batch = random_batch(np.random.default_rng(4), 16, 24, 40)
  batch['targets'][0, 0] = 5
  good_row = np.asarray(state['params']['embed']['embedding'][5])
  state['params']['embed']['embedding'] = state['params']['embed']['embedding'].at[5].set(jnp.nan)
  state, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
  assert not bool(metrics['finite'])
  assert int(optimization.schedule_count(state['opt_state'])) == int(state['step']) == 1
  assert float(metrics['learning_rate']) == pytest.approx(float(schedule(0)))
  state['params']['embed']['embedding'] = state['params']['embed']['embedding'].at[5].set(
      good_row)
  before = jax.device_get(state['params'])
  state, metrics = step_fn(state, sharding.from_host_rows(batch, batch_sharding))
  assert bool(metrics['finite'])
  learning_rate = float(metrics['learning_rate'])
  assert learning_rate == pytest.approx(float(schedule(1)))
  assert learning_rate == pytest.approx(2 * float(schedule(0)))  # Warm-up: rate ~ step.
  # Adam's first real update moves each entry by about the learning rate (m / sqrt(v) = +-1).
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(jax.device_get(
          state['params']))))
  assert moved == pytest.approx(learning_rate, rel=1e-3)


def test_nonfinite_streak_check_sees_streaks_that_ended_between_checks():
  counters = lambda *values: [{'nonfinite_in_a_row': np.int32(v)} for v in values]
  metrics.check_nonfinite_streak(counters(0, 1, 2, 0, 1), limit=3, step=5)  # Below the limit.
  with pytest.raises(FloatingPointError, match='3 consecutive steps'):
    metrics.check_nonfinite_streak(counters(0, 1, 2, 3, 0, 0), limit=3, step=6)  # Over by now.
  with pytest.raises(FloatingPointError, match='4 consecutive'):
    metrics.check_nonfinite_streak(counters(4), limit=3, step=9)  # Carried over from before.


def test_cli_rejects_an_unknown_config_key_in_one_line(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', str(tmp_path),
       '--config.model.dmodel=1'], cwd=repo, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'TRANSFORMER_KEEP_MALLOC': '1'})
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr, result.stderr
  # The flag as typed (ml_collections names only its last part) and the key it is close to.
  assert '--config.model.dmodel: the config has no such key. Did you mean --config.model.d_model?' \
      in result.stderr, result.stderr
  assert not os.listdir(tmp_path)  # Nothing started.


def test_unknown_config_key_messages_name_the_flag_and_what_replaced_a_renamed_key(monkeypatch):
  monkeypatch.setattr(sys, 'argv', ['train.py', '--config.seed=1', '--config.no_such_key=1',
                                    '--config.optimizer.cooldown_steps=500'])
  with pytest.raises(SystemExit, match=r'--config\.no_such_key: .*The config file lists them'):
    train.exit_on_unknown_config_key(KeyError("'no_such_key'"))
  with pytest.raises(SystemExit, match=r'--config\.optimizer\.cooldown_steps: .*It is now '
                     r'optimizer\.cooldown_fraction'):
    train.exit_on_unknown_config_key(AttributeError("'cooldown_steps'"))


def test_cli_distributed_without_cluster_settings_says_what_to_set(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cluster = ('SLURM_', 'OMPI_', 'JAX_COORDINATOR', 'KUBERNETES_', 'TPU_', 'CLOUD_TPU')
  env = {k: v for k, v in os.environ.items() if not k.startswith(cluster)}
  result = subprocess.run(
      [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', str(tmp_path),
       '--distributed'], cwd=repo, capture_output=True, text=True, timeout=300,
      env={**env, 'TRANSFORMER_KEEP_MALLOC': '1'})
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr, result.stderr
  assert 'JAX_COORDINATOR_ADDRESS' in result.stderr and '--process_id' in result.stderr
  assert not os.listdir(tmp_path)


def test_bad_config_errors_before_compiling():
  mesh = sharding.make_mesh('')
  with pytest.raises(config_check.ConfigError, match='divide over'):
    config_check.validate_config(small_config({'data.batch_size': 12}), mesh)
  with pytest.raises(sharding.MeshError, match='mesh_shape'):
    sharding.make_mesh('data:3')
  with pytest.raises(config_check.ConfigError, match='dtype'):
    config_check.validate_config(small_config({'model.dtype': 'no_such_dtype'}), mesh)
  with pytest.raises(config_check.ConfigError, match='num_heads'):
    config_check.validate_config(small_config({'model.num_heads': 3}), mesh)
  with pytest.raises(config_check.ConfigError, match='learning_rate_scale'):
    config_check.validate_config(
        small_config({'optimizer.learning_rate_scale': float('nan')}), mesh)
  with pytest.raises(config_check.ConfigError, match='batch_size must be positive'):
    config_check.validate_config(small_config({'data.batch_size': 0}), mesh)
  for change, message in (({'decode.beam_size': 0}, 'beam_size must be positive'),
                          ({'decode.beam_size': 401}, 'exceeds the vocabulary'),
                          ({'eval.bleu_sentences': -1}, 'bleu_sentences'),
                          ({'optimizer.label_smoothing': 1.0}, 'label_smoothing'),
                          ({'keep_checkpoints': 0}, 'keep_checkpoints'),
                          ({'data.max_length': 0}, 'max_length'),
                          ({'model.num_heads': 0}, 'num_heads must be positive'),
                          ({'model.d_ff': -8}, 'd_ff must be positive'),
                          ({'model.dropout_rate': 1.0}, r'dropout_rate must be in \[0, 1\)'),
                          ({'model.attention_implementation': 'flash'},
                           'attention_implementation must be'),
                          ({'model.attention_implementation': 'cudnn'}, 'bfloat16 or float16'),
                          ({'model.attention_implementation': 'cudnn',
                            'model.dtype': 'bfloat16'}, 'GPUs only'),
                          ({'decode.stopping': 'late'}, 'decode.stopping must be one of'),
                          ({'decode.alpha': -1.0}, 'length-penalty exponent'),
                          ({'decode.min_length': -1}, 'min_length must be an integer'),
                          ({'decode.min_length': 300}, 'min_length=300 must be below')):
    with pytest.raises(config_check.ConfigError, match=message):
      config_check.validate_config(small_config(change), mesh)


# --------------------------------------------------------------- full runs on real data


def _final_params(workdir):
  params, _ = checkpoints.load_params(str(workdir))
  return jax.device_get(params)


@needs_multi30k
def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch, one_device):
  """With the moving average of the parameters and the keep-best / early-stopping state.
  Also: metrics.jsonl holds each step once. Before, the rows of steps after the last
  checkpoint were written again by the resumed run."""
  real_init = evaluation.Evaluator.__init__

  def two_batches(self, *args, **kwargs):  # On two validation batches: the test is on resuming.
    real_init(self, *args, **kwargs)
    self.batches = self.batches[:2]

  monkeypatch.setattr(evaluation.Evaluator, '__init__', two_batches)
  config = small_config({'model.dropout_rate': 0.1, 'eval.bleu_sentences': 0,
                         'num_train_steps': 16, 'checkpoint_every_steps': 4,
                         'keep_checkpoints': 4,  # Every checkpoint: the best's EMA is read below.
                         'eval.every_steps': 4, 'optimizer.ema_decay': 0.9,
                         'eval.keep_best_metric': 'loss', 'eval.early_stopping_patience': 50})
  straight = tmp_path / 'straight'
  result = train.train_and_evaluate(config, str(straight))
  assert result['step'] == 16 and not result['early_stopped']
  assert checkpoints.saved_steps(str(straight)) == [4, 8, 12, 16]

  interrupted = tmp_path / 'interrupted'
  os.makedirs(interrupted)
  # Share the tokenizer so both runs see the same ids (training it is deterministic anyway).
  (interrupted / 'tokenizer.model').write_bytes((straight / 'tokenizer.model').read_bytes())
  first = config.copy_and_resolve_references()
  first.num_train_steps = 10
  train.train_and_evaluate(first, str(interrupted))
  # As if killed after logging step 10 but before its checkpoint landed, mid-way through a row.
  shutil.rmtree(interrupted / 'checkpoints' / '10')
  with open(interrupted / 'metrics.jsonl', 'a', encoding='utf-8') as f:
    f.write('{"step": 11, "train_lo')
  resumed = train.train_and_evaluate(config, str(interrupted))
  assert resumed['step'] == 16
  _assert_trees_close(_final_params(straight), _final_params(interrupted), atol=1e-6)
  ema, ema_resumed = (jax.device_get(checkpoints.load_params(str(run), 'ema')[0])
                      for run in (straight, interrupted))
  _assert_trees_close(ema, ema_resumed, atol=1e-6)
  assert resumed['best'] == result['best'] and result['best']['step'] in (4, 8, 12, 16)
  rows = [json.loads(line) for line in open(interrupted / 'metrics.jsonl', encoding='utf-8')]
  assert [r['step'] for r in rows if 'train_loss' in r] == [5, 10, 15, 16]
  assert [r['step'] for r in rows if 'num_params' in r] == [0]
  assert [r['best_step'] for r in rows if 'best_step' in r][-1] == result['best']['step']
  # best/ holds the moving average of the best step (decode.py --checkpoint best).
  best, origin = checkpoints.load_params(str(interrupted), 'best')
  assert f"step {result['best']['step']}" in origin
  best_step = result['best']['step']
  ema_then = checkpoints.read_checkpoint(
      checkpoints.step_path(str(interrupted), best_step),
      {'ema': jax.sharding.SingleDeviceSharding(jax.devices()[0])}, step=best_step)['ema']
  _assert_trees_close(jax.device_get(best), jax.device_get(ema_then), atol=1e-6)


@needs_multi30k
def test_max_train_minutes_stops_with_a_checkpoint_and_the_clock_carries_over(tmp_path,
                                                                            one_device):
  """A time budget ends the run (exit 0, not 'interrupted') after the step that used it up; a
  rerun of the same command trains no further; training minutes continue across resumes."""
  config = small_config({'eval.bleu_sentences': 0, 'num_train_steps': 1000,
                         'eval.every_steps': 1000, 'checkpoint_every_steps': 1000,
                         'log_every_steps': 1, 'max_train_minutes': 1e-4})
  result = train.train_and_evaluate(config, str(tmp_path))  # Any step takes over 6 ms.
  assert result['out_of_time'] and not result['stopped'] and result['step'] == 1
  assert checkpoints.saved_steps(str(tmp_path)) == [1]
  again = train.train_and_evaluate(config, str(tmp_path))
  assert again['step'] == 1 and again['out_of_time']
  config.max_train_minutes = 0.0
  config.num_train_steps = 3
  resumed = train.train_and_evaluate(config, str(tmp_path))
  assert resumed['step'] == 3 and not resumed['out_of_time']
  rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl', encoding='utf-8')]
  minutes = [r['train_minutes'] for r in rows if 'train_loss' in r]
  assert [r['step'] for r in rows if 'train_loss' in r] == [1, 2, 3]
  assert minutes[0] >= 1e-4 and minutes[0] < minutes[1] < minutes[2]
  # The run's total adds what followed step 3's row (evaluation, the checkpoint): on a busy
  # machine that may be as long as the steps themselves.
  assert resumed['train_minutes'] >= minutes[2]


def test_a_time_budget_is_decided_by_process_0_at_logging_steps(monkeypatch):
  """Several processes stop at one step: only logging steps check, with process 0's clock."""
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  broadcasts = []
  monkeypatch.setattr(loop_control.multihost_utils, 'broadcast_one_to_all',
                      lambda x: broadcasts.append(x) or x)
  clock = loop_control.TrainingClock(seconds_before=120.0)
  assert not loop_control.out_of_training_time(clock, 1.0, 7, log_step=False) and not broadcasts
  assert loop_control.out_of_training_time(clock, 1.0, 10, log_step=True) and len(broadcasts) == 1
  assert not loop_control.out_of_training_time(clock, 10.0, 20, log_step=True)
  assert not loop_control.out_of_training_time(clock, 0.0, 30, log_step=True)  # No limit.


@needs_multi30k
def test_sigint_saves_a_checkpoint_and_stops_within_a_step_of_the_device(tmp_path, monkeypatch,
                                                                         one_device):
  """Ctrl-C in the middle of training (SIGTERM: tests/test_checkpoints.py, as a process). The
  loop dispatches step k once step k - 2 has finished, so the run stops within a step of where
  the device is. Before, it ran ahead to the next logging step: SIGTERM to a 2 s/step CPU run
  stopped it 16 steps (33 s) later."""
  real_compile = train.compile_train_step
  metrics, unfinished = [], []

  def compile_and_watch(*args, **kwargs):
    step_fn, batch_sharding = real_compile(*args, **kwargs)

    def watched(state, batch):
      if len(metrics) >= 2 and not all(
          leaf.is_ready() for leaf in jax.tree_util.tree_leaves(metrics[-2])):
        unfinished.append(len(metrics))
      state, step_metrics = step_fn(state, batch)
      metrics.append(step_metrics)
      if len(metrics) == 12:  # Not a fixed delay: a slow machine may still be compiling.
        os.kill(os.getpid(), signal.SIGINT)
      return state, step_metrics

    return watched, batch_sharding

  monkeypatch.setattr(train, 'compile_train_step', compile_and_watch)
  config = small_config({'eval.bleu_sentences': 0, 'num_train_steps': 100_000,
                         'eval.every_steps': 100_000, 'checkpoint_every_steps': 100_000,
                         'log_every_steps': 100_000})  # No logging step waits for the device.
  result = train.train_and_evaluate(config, str(tmp_path))
  assert result['stopped'] and 12 <= result['step'] <= 13
  assert checkpoints.saved_steps(str(tmp_path))[-1] == result['step']
  assert not unfinished, unfinished


@needs_multi30k
def test_diverging_run_stops_with_a_clear_error_and_keeps_finite_parameters(tmp_path,
                                                                           one_device):
  # A learning rate of ~1e28 makes the first update blow the parameters up; every later step
  # then has a non-finite loss and is skipped, until the streak reaches the limit.
  config = small_config({'optimizer.learning_rate_scale': 1e30,
                         'optimizer.max_consecutive_nonfinite': 3, 'eval.bleu_sentences': 0,
                         'num_train_steps': 40, 'log_every_steps': 5, 'checkpoint_every_steps': 2,
                         'eval.every_steps': 1000})
  with pytest.raises(FloatingPointError, match='consecutive steps had a non-finite') as error:
    train.train_and_evaluate(config, str(tmp_path))
  assert 'checkpoint' in str(error.value) and 'learning_rate_scale' in str(error.value)
  manager = checkpoints.make_manager(str(tmp_path), read_only=True)
  assert manager.latest_step() == 4  # Stopped at the first check (step 5), not at step 40.
  params, _ = checkpoints.load_params(str(tmp_path))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(params))
  meta = manager.restore(4, args=checkpoints.ocp.args.Composite(
      meta=checkpoints.ocp.args.JsonRestore()))['meta']
  assert meta['nonfinite_in_a_row'] == 3 and meta['nonfinite_total'] == 3


@needs_multi30k
def test_metrics_evaluation_and_bleu_follow_their_own_schedules(tmp_path, caplog):
  config = small_config({'eval.bleu_every_steps': 4, 'eval.bleu_sentences': 8,
                         'num_train_steps': 8, 'log_every_steps': 2, 'eval.every_steps': 6,
                         'checkpoint_every_steps': 1000})
  with caplog.at_level('INFO'):
    result = train.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl', encoding='utf-8')]
  steps_with = lambda key: [r['step'] for r in records if key in r]
  assert steps_with('train_loss') == [2, 4, 6, 8]
  assert steps_with('eval_nll') == [6, 8]
  assert steps_with('eval_bleu') == [4, 8] and steps_with('eval_chrf') == [4, 8]
  assert steps_with('num_params') == [0]
  assert all(r['target_tokens_per_second'] > 0 for r in records if 'train_loss' in r)
  assert any(name.startswith('events.out.tfevents')
             for name in os.listdir(tmp_path / 'tensorboard'))
  assert 'First step (trace, compile, run)' in caplog.text and 'ETA' in caplog.text
  # Two BLEU evaluations, one search program per source-length bucket: the second compiles
  # nothing (a search rebuilt per call would build every bucket's program again).
  translator = result['translator']
  buckets = {arrays['inputs'].shape for _, arrays in batching.length_batches(
      {'inputs': translator.tokenizer.encode(input_pipeline.read_split(config, 'val')[0][:8])},
      config.decode.batch_tokens, config.model.max_len)}
  assert translator.compiles == len(buckets)


@needs_multi30k
@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters(tmp_path):
  """SIGKILL (no chance to save) after a checkpoint, restart: same result as no kill."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  overrides = ['--config.num_train_steps=400', '--config.checkpoint_every_steps=100',
               '--config.eval.every_steps=1000', '--config.eval.bleu_sentences=0',
               '--config.model.dropout_rate=0.1']

  def command(workdir):
    return [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir',
            str(workdir), *overrides]

  straight, killed = tmp_path / 'straight', tmp_path / 'killed'
  subprocess.run(command(straight), cwd=repo, check=True, capture_output=True, timeout=1200)
  os.makedirs(killed)
  (killed / 'tokenizer.model').write_bytes((straight / 'tokenizer.model').read_bytes())
  process = subprocess.Popen(command(killed), cwd=repo, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.time() + 900
  while not (killed / 'checkpoints' / '200').is_dir() and time.time() < deadline:
    time.sleep(0.2)
  process.kill()
  process.wait()
  assert (killed / 'checkpoints' / '200').is_dir()
  assert not (killed / 'checkpoints' / '400').is_dir(), 'the run ended before the kill'
  subprocess.run(command(killed), cwd=repo, check=True, capture_output=True, timeout=1200)
  _assert_trees_close(_final_params(straight), _final_params(killed), atol=1e-6)


def test_training_clock_leaves_out_paused_time(monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(loop_control.time, 'time', lambda: now[0])
  clock = loop_control.TrainingClock(seconds_before=60.0)
  now[0] += 30
  with clock.paused():
    now[0] += 100  # Validation.
    assert clock.seconds() == 90.0
  now[0] += 30
  assert clock.seconds() == 120.0 and clock.minutes() == 2.0
