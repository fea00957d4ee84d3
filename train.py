"""Trains a model of configs/: data-parallel over every device, with checkpoints and validation.

  python train.py --config configs/multi30k.py --workdir runs/multi30k [--config.GROUP.KEY=value]

Restarting with the same workdir resumes from the newest intact checkpoint (parameters,
optimizer state, step, RNG and data position); `--init_params_from=RUN` starts a new workdir
from another run's parameters. SIGTERM/SIGINT save a checkpoint and exit with code 75
(interrupted, resumable). One trainer per workdir (nmt/workdir_lock.py). On several hosts,
start the same command on each with --distributed (docs/clusters.md).
"""

from __future__ import annotations

if __name__ == '__main__':
  # First, before the heavy imports: this may restart the interpreter (nmt/glibc_malloc.py).
  from nmt import glibc_malloc

  glibc_malloc.reexec_with_malloc_settings()

import os
import re
import sys
import traceback
from typing import Any

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

import input_pipeline
from model import count_params, make_model
from nmt import (
    checkpoints,
    console,
    sharding,
    startup,
    train_state,
    workdir_lock,
)
from nmt.config_check import RENAMED_CONFIG_KEYS, ConfigError, validate_config
from nmt.evaluation import Evaluator
from nmt.keep_best import KeepBest
from nmt.loop_control import (
    EXIT_INTERRUPTED,
    StopRequests,
    TrainingClock,
    is_time,
    out_of_training_time,
)
from nmt.metrics import MetricsWriter, TrainingLog, check_nonfinite_streak
from nmt.optimization import compile_train_step, make_optimizer

FLAGS = flags.FLAGS


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       init_params_from: str | None = None) -> dict[str, Any]:
  """Runs (or resumes) training; returns the final state, step and last metrics.

  SIGTERM/SIGINT at any point, data loading and compilation included, end the run after the
  current step with a checkpoint ('stopped' in the result). With several processes, a signal
  to any of them stops every process after the same step (`StopRequests`). A fresh run starts
  from the parameters of `init_params_from` when given (`train_state.restore_or_init`).
  """
  mesh = sharding.make_mesh(config.mesh_shape)
  validate_config(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  # The lock comes before anything else touches the workdir.
  with StopRequests() as stop_requests, workdir_lock.WorkdirLock(workdir):
    return _train_and_evaluate(config, workdir, mesh, stop_requests, init_params_from)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, mesh: jax.sharding.Mesh,
                        stop_requests: StopRequests,
                        init_params_from: str | None) -> dict[str, Any]:
  if config.data.target_pieces_first:
    # The output layer covers the training targets' pieces: the tokenizer (trained here on a
    # fresh run, or the one --init_params_from's parameters were trained with) comes first.
    if init_params_from and not os.path.isfile(os.path.join(workdir, 'tokenizer.model')):
      train_state.copy_tokenizer(init_params_from, workdir)
    tokenizer = input_pipeline.load_or_train_tokenizer(config, workdir,
                                                       process_index=jax.process_index())
    needed = input_pipeline.output_vocab_size(config, tokenizer,
                                              process_index=jax.process_index())
    if config.model.output_vocab_size not in (0, needed):
      raise ConfigError(f'model.output_vocab_size={config.model.output_vocab_size}, but the '
                        f'training targets need {needed} with data.target_pieces_first: '
                        'leave it 0 (train.py sets it).')
    config.model.output_vocab_size = needed
  # Model, optimizer, and the state from the newest checkpoint or fresh: before anything in
  # the workdir changes, so a config that does not fit the checkpoints changes nothing.
  model = make_model(config.model)
  optimizer = make_optimizer(config)
  state, shardings, meta = train_state.restore_or_init(config, model, optimizer, mesh, workdir,
                                                       init_params_from)
  meta = meta or {}
  if init_params_from and not meta:
    train_state.copy_tokenizer(init_params_from, workdir)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2))
  logging.info('Config written to %s (--verbosity=1 also logs it).',
               os.path.join(workdir, 'config.json'))
  logging.debug('Config:\n%s', config)
  num_params = count_params(state['params'])
  logging.info('Model: %s parameters; %s', f'{num_params:,}', model.config)
  logging.info('Mesh: %s over %d devices on %d hosts.', dict(mesh.shape), mesh.devices.size,
               jax.process_count())

  # Data: the tokenizer, this process's share of the training batches (where the checkpoint
  # left them), the validation batches.
  data = input_pipeline.make_data(
      config, workdir, data_state=meta.get('data_state'), row_multiple=mesh.devices.size,
      process_index=jax.process_index(), process_count=jax.process_count())
  tokenizer, train_iter = data.tokenizer, data.train

  step_fn, batch_sharding = compile_train_step(config, model, optimizer, mesh, shardings)
  evaluator = Evaluator(config, model, tokenizer, mesh, shardings['params'], data.eval_batches,
                        data.eval_sources, data.eval_targets)
  manager = checkpoints.make_manager(workdir, max_to_keep=config.keep_checkpoints)
  ema = 'ema_params' in state
  keep_best = KeepBest(config.eval, workdir, meta.get('best'), ema=ema)
  clock = TrainingClock(meta.get('train_seconds', 0.0))
  time_limit = config.get('max_train_minutes', 0.0)
  start_step = step = int(jax.device_get(state['step']))
  last_step = config.num_train_steps
  writer = MetricsWriter(workdir, start_step)
  if start_step == 0:
    writer.write(0, {'num_params': num_params})
  log = TrainingLog(writer, start_step, last_step, config.log_every_steps, clock, time_limit)
  if ema:
    logging.info('Keeping a moving average of the parameters (decay %g); validation uses it.',
                 config.optimizer.ema_decay)

  def save(step: int) -> None:
    counters = jax.device_get({k: state[k] for k in ('nonfinite_total', 'nonfinite_in_a_row')})
    meta = {'step': step, 'data_state': train_state.whole_data_state(train_iter),
            'best': keep_best.state, 'train_seconds': clock.seconds(),
            **{k: int(v) for k, v in counters.items()}}
    checkpoints.save(manager, step, state['params'],
                     {k: state[k] for k in ('opt_state', 'rng')}, meta,
                     ema=state['ema_params'] if ema else None)

  sync_each_step = sharding.one_program_in_flight(mesh)
  logging.info('Training from step %d to %d.', start_step, last_step)
  stopped = stop_requests.stop_after(step)
  # A run resumed after its budget was used up trains no further.
  out_of_time = bool(time_limit) and clock.seconds_before / 60 >= time_limit
  previous_metrics = None
  while step < last_step and not (stopped or keep_best.stopped or out_of_time):
    batch = sharding.from_host_rows(next(train_iter), batch_sharding)
    with jax.transfer_guard('disallow'):
      state, step_metrics = step_fn(state, batch)
    # At most two steps in flight (one with several CPU devices): the device never waits for
    # the host, and a signal stops the run within a step of where the device is, not after
    # every step dispatched ahead up to the next logging step (a preemption notice can be 30 s).
    jax.block_until_ready(step_metrics if sync_each_step else previous_metrics)
    previous_metrics = step_metrics
    step += 1

    fetched = log.record(step, step_metrics)
    try:
      check_nonfinite_streak(fetched, config.optimizer.max_consecutive_nonfinite, step)
    except FloatingPointError as error:
      manager.wait_until_finished()
      raise FloatingPointError(
          f'{error} The newest checkpoint in {manager.directory} holds the last good '
          'parameters (skipped steps change nothing): lower the learning rate '
          '(optimizer.learning_rate_scale) or enable optimizer.grad_clip_norm.') from None

    if evaluator.due(step):
      jax.block_until_ready(step_metrics)  # The steps so far count as training.
      with clock.paused():
        evaluated = state['ema_params'] if ema else state['params']
        eval_metrics = evaluator(evaluated, step)
        eval_metrics.update(keep_best.update(step, eval_metrics, evaluated))
      logging.info('eval at step %d%s: %s', step, ' (moving average)' if ema else '',
                   ', '.join(f'{k} {v:.4g}' for k, v in eval_metrics.items()))
      log.write_evaluation(step, eval_metrics)

    out_of_time = out_of_training_time(clock, time_limit, step,
                                       is_time(step, config.log_every_steps, last_step))
    if is_time(step, config.checkpoint_every_steps, last_step) or out_of_time:
      save(step)
    stopped = stop_requests.stop_after(step)

  if (stopped or keep_best.stopped) and manager.latest_step() != step:
    save(step)
  manager.wait_until_finished()
  writer.close()
  train_iter.close()
  report_end(step, stopped, out_of_time, time_limit, keep_best, clock, log, manager.directory,
             workdir)
  return {'state': state, 'metrics': log.last, 'step': step, 'stopped': stopped,
          'early_stopped': keep_best.stopped, 'out_of_time': out_of_time,
          'best': keep_best.state, 'train_minutes': clock.minutes(),
          'translator': evaluator.translator}


def report_end(step: int, stopped: bool, out_of_time: bool, time_limit: float,
               keep_best: KeepBest, clock: TrainingClock, log: TrainingLog, checkpoint_dir: str,
               workdir: str) -> None:
  """One line on why training ended and where its checkpoints are."""
  if stopped:
    logging.warning('Stopped by signal at step %d with a checkpoint; rerun the same command to '
                    'resume (exit code %d).', step, EXIT_INTERRUPTED)
  elif out_of_time:
    logging.info('Stopped at step %d: max_train_minutes=%g reached (%.1f training minutes); '
                 'checkpoints in %s.', step, time_limit, clock.minutes(), checkpoint_dir)
  elif keep_best.stopped:
    best = keep_best.state
    logging.info('Stopped early at step %d: no improvement of %s in %d evaluations; best %.4g '
                 'at step %d, in %s.', step, keep_best.metric, keep_best.patience, best['value'],
                 best['step'], os.path.join(workdir, checkpoints.BEST_DIR))
  else:
    logging.info('Done: step %d in %s; checkpoints in %s.', step,
                 console.format_duration(log.wall_minutes() * 60), checkpoint_dir)


# ----------------------------------------------------------------------------- command line


def exit_on_unknown_config_key(error: Exception):
  # ml_collections names only the missing leaf (and may suggest a near one); the flag as typed
  # names its group too.
  message = str(error)
  leaf = re.search(r'\w+', message).group()
  given = [arg[2:].split('=')[0] for arg in sys.argv[1:] if arg.startswith('--config.')]
  key = next((k for k in given if k.rsplit('.', 1)[-1] == leaf), f'config.{leaf}')
  suggestion = re.search(r'Did you mean "(\w+)"', message)
  renamed = [new for old, new in RENAMED_CONFIG_KEYS.items() if old.rsplit('.', 1)[-1] == leaf]
  if renamed:
    hint = f' It is now {renamed[0]}.'
  elif suggestion:
    hint = f' Did you mean --{key.rsplit(".", 1)[0]}.{suggestion.group(1)}?'
  else:
    hint = (' The config file lists them; keys are grouped, e.g. --config.model.d_model, '
            '--config.data.batch_size.')
  sys.exit(f'error: --{key}: the config has no such key.{hint}')


def define_flags():
  """Command-line flags (defined only when run as a script, so other code can import us)."""
  try:
    # Applies --config.KEY overrides to the default config file already, as well as at parsing.
    config_flags.DEFINE_config_file('config', 'configs/multi30k.py', 'Training config file.')
  except (AttributeError, KeyError) as error:
    exit_on_unknown_config_key(error)
  flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, logs, tokenizer).')
  startup.define_distributed_flags()
  flags.DEFINE_string('init_params_from', None, 'A fresh run starts from the parameters of '
                      "another run: 'RUN_DIR' (its newest checkpoint), 'RUN_DIR:STEP', "
                      "'RUN_DIR:averaged', 'RUN_DIR:best' or 'RUN_DIR:ema'; optimizer state and "
                      'step start anew (fine-tuning).')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing (a one-line error for a bad value), and one line for an unknown key too."""
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as error:  # ml_collections' error for a missing key.
    exit_on_unknown_config_key(error)


def out_of_space_message(workdir: str) -> str:
  try:
    steps = checkpoints.saved_steps(workdir)
  except FileNotFoundError:
    steps = []
  kept = (f'the checkpoints written before (newest: step {steps[-1]}) are intact' if steps
          else 'no checkpoint had been written')
  return (f'no space left to write in {os.path.abspath(workdir)}: {kept}. Free some space, then '
          'rerun the same command to resume.')


def fail(message: str, at_once: bool = False) -> None:
  """Ends the process with one error line and exit code 1.

  With several processes it leaves at once: a normal exit waits in JAX's shutdown barrier for
  peers that may be waiting for this process elsewhere (five minutes, then an abort). The
  coordination service tells the peers; they stop with an error too.
  """
  logging.error('%s', message)
  sys.stderr.write(f'error: {message}\n')
  sys.stderr.flush()
  if at_once or jax.process_count() > 1:
    os._exit(1)
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if FLAGS.workdir is None:
    sys.exit('error: --workdir is required.')
  startup.start(FLAGS.workdir)
  try:
    result = train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.init_params_from)
  except (ConfigError, sharding.MeshError, input_pipeline.DataError, FileNotFoundError,
          FloatingPointError, checkpoints.CheckpointMismatchError,
          checkpoints.DamagedCheckpointError, workdir_lock.WorkdirLockedError) as error:
    fail(str(error))
  except Exception as error:  # noqa: BLE001 - a full disk is one line; the rest a traceback.
    if console.is_out_of_space(error):
      # Orbax's writer threads may still hold the failed save: leave without waiting for them.
      fail(out_of_space_message(FLAGS.workdir), at_once=True)
    if jax.process_count() == 1:
      raise
    traceback.print_exc()
    if console.is_lost_peer(error):
      fail(f'process {jax.process_index()} lost another process of this run mid-step (it died '
           f'or its host dropped off the network): {error}. Restart every process with the same '
           'command to resume from the last checkpoint.')
    fail(f'process {jax.process_index()} failed: {type(error).__name__}: {error}')
  if result['stopped']:
    sys.exit(EXIT_INTERRUPTED)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=parse_flags)
