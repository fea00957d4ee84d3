"""Checkpoints of a training run with orbax: save, resume with fallback, average, load for decoding.

A checkpoint holds three items: `params`, `optimizer` (optimizer state and training RNG) and
`meta` (step, data-iterator position, skip counters) as JSON. Orbax writes each step to a
temporary folder and renames it when complete, so a crash mid-write never leaves a checkpoint
that restores garbage; a damaged checkpoint is skipped on restore with a warning.

Averaging (the paper averaged the last 5 checkpoints of base models, 20 of big ones):

  python checkpoints.py --workdir runs/multi30k [--average_last N]

writes `WORKDIR/averaged/` which `decode.py --checkpoint averaged` reads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from jax.experimental import multihost_utils

CHECKPOINT_DIR = 'checkpoints'
AVERAGED_DIR = 'averaged'


def make_manager(workdir: str, max_to_keep: int | None = None,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """The run's checkpoint manager: asynchronous saves, the last `max_to_keep` kept."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=not read_only, read_only=read_only,
      create=not read_only, cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR)),
                               options=options, item_names=('params', 'optimizer', 'meta'))


def save(manager: ocp.CheckpointManager, step: int, params: Any, optimizer_state: Any,
         meta: dict[str, Any]) -> None:
  """Starts an asynchronous save of `step` (call `manager.wait_until_finished()` before exit)."""
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      optimizer=ocp.args.StandardSave(optimizer_state),
      meta=ocp.args.JsonSave(meta)), force=True)


def restore_latest(manager: ocp.CheckpointManager, abstract_params: Any,
                   abstract_optimizer_state: Any) -> tuple[Any, Any, dict[str, Any]] | None:
  """Restores the newest readable checkpoint into the given shardings/shapes.

  Returns (params, optimizer_state, meta), or None when there is no checkpoint. A checkpoint
  that fails to restore is reported and the next older one is tried.
  """
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      restored = manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params),
          optimizer=ocp.args.StandardRestore(abstract_optimizer_state),
          meta=ocp.args.JsonRestore()))
    except Exception as error:  # noqa: BLE001 - any damage means: try the previous one.
      _set_aside(manager, step, f'{type(error).__name__}: {str(error)[:300]}')
      continue
    meta = restored['meta']
    if meta.get('step') != step:
      _set_aside(manager, step, f'its meta says step {meta.get("step")}')
      continue
    return restored['params'], restored['optimizer'], meta
  return None


def _set_aside(manager: ocp.CheckpointManager, step: int, reason: str) -> None:
  """Renames a damaged checkpoint out of the manager's view (kept for inspection)."""
  path = os.path.join(str(manager.directory), str(step))
  aside = f'{path}.damaged'
  logging.warning('Checkpoint at step %d in %s cannot be restored (%s); falling back to the '
                  'previous checkpoint. The damaged one is kept as %s.', step,
                  manager.directory, reason, aside)
  if jax.process_index() == 0:
    if os.path.exists(aside):
      shutil.rmtree(aside)
    os.rename(path, aside)
  if jax.process_count() > 1:  # Every host rescans only after process 0 has renamed it.
    multihost_utils.sync_global_devices(f'checkpoint {step} set aside')
  manager.reload()


def _restore_params(manager: ocp.CheckpointManager, step: int) -> Any:
  restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
  return jax.tree_util.tree_map(np.asarray, restored['params'])


def average_last(workdir: str, num_checkpoints: int) -> tuple[Any, list[int]]:
  """Element-wise mean (float32) of the params of the newest `num_checkpoints` checkpoints."""
  manager = make_manager(workdir, read_only=True)
  steps = sorted(manager.all_steps())[-num_checkpoints:]
  if not steps:
    raise FileNotFoundError(f'No checkpoints in {manager.directory}: train first.')
  if len(steps) < num_checkpoints:
    logging.warning('Asked to average %d checkpoints; only %d exist (steps %s).',
                    num_checkpoints, len(steps), steps)
  total = None
  for step in steps:
    params = _restore_params(manager, step)
    params = jax.tree_util.tree_map(lambda x: x.astype(np.float64), params)
    total = params if total is None else jax.tree_util.tree_map(np.add, total, params)
  averaged = jax.tree_util.tree_map(lambda x: (x / len(steps)).astype(np.float32), total)
  return averaged, steps


def save_averaged(workdir: str, num_checkpoints: int) -> list[int]:
  """Averages the newest checkpoints into WORKDIR/averaged/ (params only)."""
  params, steps = average_last(workdir, num_checkpoints)
  checkpointer = ocp.StandardCheckpointer()
  path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
  checkpointer.save(path, params, force=True)
  checkpointer.wait_until_finished()
  logging.info('Averaged steps %s into %s.', steps, path)
  return steps


def load_params(workdir: str, checkpoint: str | int | None = None,
                average: int = 0) -> tuple[Any, str]:
  """Parameters for decoding, and a description of where they came from.

  Args:
    workdir: the training run's workdir.
    checkpoint: None = newest, a step number, or 'averaged' (WORKDIR/averaged/).
    average: if > 0, the mean of the newest `average` checkpoints instead.
  """
  if average > 0:
    params, steps = average_last(workdir, average)
    return params, f'average of steps {steps}'
  if checkpoint == 'averaged':
    path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
    if not os.path.isdir(path):
      raise FileNotFoundError(f'No averaged checkpoint at {path}: run `python checkpoints.py '
                              f'--workdir {workdir} --average_last N` first.')
    params = ocp.StandardCheckpointer().restore(path)
    return jax.tree_util.tree_map(np.asarray, params), f'averaged checkpoint {path}'
  checkpoint_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(checkpoint_dir):
    raise FileNotFoundError(f'No checkpoints in {checkpoint_dir}: is {workdir} a training '
                            'workdir, and has training saved a checkpoint yet?')
  manager = make_manager(workdir, read_only=True)
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f'No checkpoints in {checkpoint_dir}: train first.')
  step = steps[-1] if checkpoint is None else int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'No checkpoint at step {step} in {checkpoint_dir}; have {steps}.')
  return _restore_params(manager, step), f'step {step}'


def main(argv):
  del argv
  count = FLAGS.average_last
  if count is None:  # The run's own choice, from its config.
    with open(os.path.join(FLAGS.workdir, 'config.json'), encoding='utf-8') as f:
      count = json.load(f)['average_last_checkpoints']
  save_averaged(FLAGS.workdir, count)


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Training workdir.', required=True)
  flags.DEFINE_integer('average_last', None, 'Number of newest checkpoints to average '
                       "(default: the run config's average_last_checkpoints).")
  FLAGS = flags.FLAGS
  app.run(main)
