"""Checkpoints of a training run with orbax: save, resume with fallback, average, load for decoding.

A checkpoint holds three items: `params`, `optimizer` (optimizer state and training RNG) and
`meta` (step, data-iterator position, skip counters) as JSON. Orbax writes each step to a
temporary folder and renames it when complete, so a crash mid-write never leaves a checkpoint
that restores garbage; a damaged checkpoint is skipped on restore with a warning. Every restore
reads straight into the caller's device layout (target shardings), so a run trained on N devices
decodes, averages and resumes on M.

Averaging (the paper averaged the last 5 checkpoints of base models, 20 of big ones):

  python checkpoints.py --workdir runs/multi30k [--average_last N]

writes `WORKDIR/averaged/` which `decode.py --checkpoint averaged` reads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from etils import epath
from jax.experimental import multihost_utils

import console

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
  logging.info('Saving checkpoint at step %d.', step)


class CheckpointMismatchError(ValueError):
  """Readable checkpoints whose parameters do not fit the model being trained."""


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in flat}


def parameter_differences(saved: Any, wanted: Any, limit: int = 6) -> list[str]:
  """What differs between two parameter trees' names and shapes (empty: they fit)."""
  saved, wanted = _shapes(saved), _shapes(wanted)
  differences = [f'{k}: saved {saved[k]}, model {wanted[k]}'
                 for k in sorted(saved.keys() & wanted.keys()) if saved[k] != wanted[k]]
  differences += [f'{k}: only in the checkpoint' for k in sorted(saved.keys() - wanted.keys())]
  differences += [f'{k}: only in the model' for k in sorted(wanted.keys() - saved.keys())]
  return differences[:limit] + ([f'... {len(differences) - limit} more'] if
                                len(differences) > limit else [])


def _saved_tree(path: str) -> Any:
  """The tree of array metadata (shape, dtype) of a saved item (a StandardSave folder)."""
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
  return getattr(tree, 'tree', tree)


def _saved_params(manager: ocp.CheckpointManager, step: int) -> Any:
  """The params item's tree of array metadata of checkpoint `step`."""
  return _saved_tree(os.path.join(str(manager.directory), str(step), 'params'))


def restore_latest(manager: ocp.CheckpointManager, abstract_params: Any,
                   abstract_optimizer_state: Any) -> tuple[Any, Any, dict[str, Any]] | None:
  """Restores the newest readable checkpoint into the given shapes and shardings.

  Returns (params, optimizer_state, meta), or None when there is no checkpoint. A checkpoint
  that fails to restore is reported, set aside, and the next older one is tried; readable
  checkpoints whose parameters do not fit `abstract_params` (another model config) raise
  CheckpointMismatchError and nothing is set aside.
  """
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      saved = _saved_params(manager, step)
      if not _shapes(saved):
        raise ValueError('its params metadata lists no arrays')
    except Exception as error:  # noqa: BLE001 - unreadable metadata is damage.
      _set_aside(manager, step, f'{type(error).__name__}: {str(error)[:300]}')
      continue
    differences = parameter_differences(saved, abstract_params)
    if differences:
      raise CheckpointMismatchError(
          f'The checkpoints in {manager.directory} (newest: step {step}) do not fit this '
          f'config\'s model: {"; ".join(differences)}. Nothing was changed. Train with the '
          'config the run was made with (its config.json), or start a new --workdir.')
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


def _restore_tree(path: str, sharding: jax.sharding.Sharding) -> Any:
  """The arrays saved at `path` (a StandardSave item), each whole on `sharding`'s devices.

  The targets come from the saved metadata (shapes, dtypes) with the caller's sharding, so the
  devices the arrays were saved from do not matter.
  """
  targets = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding),
      _saved_tree(path))
  # The item's handler itself: a Checkpointer would look for step-level metadata and warn.
  return ocp.StandardCheckpointHandler().restore(epath.Path(path),
                                                 args=ocp.args.StandardRestore(targets))


def _local_sharding() -> jax.sharding.Sharding:
  """Every array whole on this process's first device (averaging works on host copies)."""
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def saved_steps(workdir: str) -> list[int]:
  """The steps of the run's complete checkpoints, oldest first (orbax renames a checkpoint to
  its step number only once it is complete; set-aside ones are `N.damaged`)."""
  folder = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(folder):
    raise FileNotFoundError(f'No checkpoints in {folder}: is {workdir} a training workdir, and '
                            'has training saved a checkpoint yet?')
  return sorted(int(name) for name in os.listdir(folder)
                if name.isdigit() and os.path.isdir(os.path.join(folder, name)))


def restore_params(workdir: str, step: int,
                   sharding: jax.sharding.Sharding | None = None) -> Any:
  """The params of checkpoint `step`, laid out as `sharding` (default: one local device)."""
  path = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR, str(step), 'params'))
  return _restore_tree(path, sharding or _local_sharding())


def average_last(workdir: str, num_checkpoints: int) -> tuple[Any, list[int]]:
  """Element-wise mean (float32, host numpy) of the params of the newest checkpoints."""
  steps = saved_steps(workdir)[-num_checkpoints:]
  if not steps:
    raise FileNotFoundError(f'No checkpoints in {workdir}/{CHECKPOINT_DIR}: train first.')
  if len(steps) < num_checkpoints:
    logging.warning('Asked to average %d checkpoints; only %d exist (steps %s).',
                    num_checkpoints, len(steps), steps)
  total = None
  for step in steps:
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64),
                                    restore_params(workdir, step))
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


def load_params(workdir: str, checkpoint: str | int | None = None, average: int = 0,
                sharding: jax.sharding.Sharding | None = None) -> tuple[Any, str]:
  """Parameters for decoding, laid out as `sharding`, and where they came from.

  Args:
    workdir: the training run's workdir.
    checkpoint: None = newest, a step number, or 'averaged' (WORKDIR/averaged/).
    average: if > 0, the mean of the newest `average` checkpoints instead.
    sharding: the target layout (default: one local device).
  """
  sharding = sharding or _local_sharding()
  if average > 0:
    params, steps = average_last(workdir, average)
    return jax.device_put(params, sharding), f'average of steps {steps}'
  if checkpoint == 'averaged':
    path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
    if not os.path.isdir(path):
      raise FileNotFoundError(f'No averaged checkpoint at {path}: run `python checkpoints.py '
                              f'--workdir {workdir} --average_last N` first.')
    return _restore_tree(path, sharding), f'averaged checkpoint {path}'
  checkpoint_dir = os.path.join(workdir, CHECKPOINT_DIR)
  steps = saved_steps(workdir)
  if not steps:
    raise FileNotFoundError(f'No checkpoints in {checkpoint_dir}: train first.')
  if checkpoint is not None and not str(checkpoint).isdigit():
    raise ValueError(f"--checkpoint must be a step number or 'averaged', got {checkpoint!r}.")
  step = steps[-1] if checkpoint is None else int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'No checkpoint at step {step} in {checkpoint_dir}; have {steps}.')
  return restore_params(workdir, step, sharding), f'step {step}'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  console.quiet_libraries()
  count = FLAGS.average_last
  try:
    if count is None:  # The run's own choice, from its config.
      with open(os.path.join(FLAGS.workdir, 'config.json'), encoding='utf-8') as f:
        saved = json.load(f)
      count = saved.get('average_last_checkpoints')
      if count is None:
        raise ValueError(f'{FLAGS.workdir}/config.json has no average_last_checkpoints; '
                         'pass --average_last N.')
    save_averaged(FLAGS.workdir, count)
  except (FileNotFoundError, ValueError) as error:
    sys.exit(f'error: {error}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Training workdir.', required=True)
  flags.DEFINE_integer('average_last', None, 'Number of newest checkpoints to average '
                       "(default: the run config's average_last_checkpoints).")
  FLAGS = flags.FLAGS
  app.run(main)
