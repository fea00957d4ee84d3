"""Checkpoints of a training run with orbax: save, verified restore with fallback, averaging.

A checkpoint holds three items: `params`, `optimizer` (optimizer state and training RNG) and
`meta` (step, data-iterator position, skip counters, keep-best state, and a checksum of every
saved array) as JSON; and with `optimizer.ema_decay`, a fourth, `ema` (the moving average of
the parameters). Orbax writes each step to a temporary folder and renames it when complete,
so a crash mid-write never leaves a checkpoint that looks complete.

Every restore (training, decoding, averaging, `--init_params_from`) goes through
`read_checkpoint`: it compares the saved shapes with the model's (a mismatch is the user's
config, `CheckpointMismatchError`, and changes nothing), restores, and recomputes each array's
checksum (a difference, or files orbax cannot read, is damage: `DamagedCheckpointError`).
`restore_newest` falls back from a damaged checkpoint to the next older one with a one-line
warning; training also renames it `N.damaged` (kept, never deleted), readers leave it in place.
With several processes, every process takes the same verdict (a checkpoint one of them cannot
read is unusable for all), so they skip, stop or go on together.
Restores read straight into the caller's device layout (target shardings), so a run trained on
N devices decodes, averages and resumes on M.

Averaging (`average.py`; the paper averaged the last 5 checkpoints of base models, 20 of big
ones) writes `WORKDIR/averaged/`, which `decode.py --checkpoint averaged` reads. Training with
`eval.keep_best_metric` writes `WORKDIR/best/` (`--checkpoint best`) the same way; `--checkpoint
ema` reads the newest checkpoint's moving average.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from nmt import legacy
from nmt.checksums import checksums, path_name

CHECKPOINT_DIR = 'checkpoints'
AVERAGED_DIR = 'averaged'
BEST_DIR = 'best'
# What --checkpoint names besides a step number.
NAMED_CHECKPOINTS = ('averaged', 'best', 'ema')
T = TypeVar('T')


def split_run_checkpoint(spec: str) -> tuple[str, str | None]:
  """'RUN' or 'RUN:CHECKPOINT' (a step number or one of NAMED_CHECKPOINTS) -> (RUN, CHECKPOINT
  or None). Any other text after the last ':' belongs to the run's path."""
  run, _, checkpoint = spec.rpartition(':')
  if run and (checkpoint.isdigit() or checkpoint in NAMED_CHECKPOINTS):
    return run, checkpoint
  return spec, None


class CheckpointMismatchError(ValueError):
  """Readable checkpoints whose arrays do not fit the model or optimizer being restored."""


class DamagedCheckpointError(Exception):
  """A checkpoint that cannot be read back as it was saved (files missing, unreadable, or
  arrays whose checksums differ from the ones recorded at saving)."""


# ----------------------------------------------------------------------------- saving


def make_manager(workdir: str, max_to_keep: int | None = None,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """The run's checkpoint manager: asynchronous saves, the last `max_to_keep` kept."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=not read_only, read_only=read_only,
      create=not read_only, cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR)),
                               options=options,
                               item_names=('params', 'optimizer', 'meta', 'ema'))


def save(manager: ocp.CheckpointManager, step: int, params: Any, optimizer_state: Any,
         meta: dict[str, Any], ema: Any = None) -> None:
  """Starts an asynchronous save of `step` (call `manager.wait_until_finished()` before exit).

  The arrays' checksums are computed first and saved in `meta`. `ema`: the parameters' moving
  average, if training keeps one.
  """
  items = {'params': params, 'optimizer': optimizer_state}
  if ema is not None:
    items['ema'] = ema
  meta = dict(meta, checksums={name: checksums(tree) for name, tree in items.items()})
  manager.save(step, args=ocp.args.Composite(
      **{name: ocp.args.StandardSave(tree) for name, tree in items.items()},
      meta=ocp.args.JsonSave(meta)), force=True)
  logging.info('Saving checkpoint at step %d.', step)


# ----------------------------------------------------------------------------- reading


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {path_name(path): tuple(leaf.shape) for path, leaf in flat}


def tree_differences(saved: Any, wanted: Any, limit: int = 6) -> list[str]:
  """What differs between two trees' array names and shapes (empty: they fit)."""
  saved, wanted = _shapes(saved), _shapes(wanted)
  differences = [f'{k}: saved {saved[k]}, model {wanted[k]}'
                 for k in sorted(saved.keys() & wanted.keys()) if saved[k] != wanted[k]]
  differences += [f'{k}: only in the checkpoint' for k in sorted(saved.keys() - wanted.keys())]
  differences += [f'{k}: only in the model' for k in sorted(wanted.keys() - saved.keys())]
  return differences[:limit] + ([f'... {len(differences) - limit} more'] if
                                len(differences) > limit else [])


def _short(error: BaseException) -> str:
  """An exception as one short line (orbax and tensorstore errors run to many lines)."""
  text = ' '.join(str(error).split())
  # Orbax appends "See full TensorStore details: <bound method ...>" (a method, not the text).
  text = text.split(' See full TensorStore details:')[0]
  return f'{type(error).__name__}: {text[:200]}{"..." if len(text) > 200 else ""}'


def _saved_tree(path: str) -> Any:
  """The tree of array metadata (shape, dtype) of a saved item; DamagedCheckpointError if it
  cannot be read or lists no arrays."""
  try:
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
  except Exception as error:  # noqa: BLE001 - orbax raises many kinds; all mean unreadable.
    raise DamagedCheckpointError(f'{os.path.basename(path)} metadata unreadable '
                                 f'({_short(error)})') from None
  tree = getattr(tree, 'tree', tree)
  if not _shapes(tree):
    raise DamagedCheckpointError(f'{os.path.basename(path)} metadata lists no arrays')
  return tree


def _read_meta(path: str) -> dict[str, Any]:
  try:
    meta = ocp.JsonCheckpointHandler().restore(epath.Path(path) / 'meta')
  except Exception as error:  # noqa: BLE001
    raise DamagedCheckpointError(f'meta unreadable ({_short(error)})') from None
  if not isinstance(meta, dict):
    raise DamagedCheckpointError('meta is not a JSON object')
  return meta


def _restore_item(path: str, target: Any) -> Any:
  """Restores one saved item into `target`, without verifying it (this process only).

  target: an abstract tree (jax.ShapeDtypeStruct leaves with shardings) that must match the
  saved names and shapes, or a Sharding: the arrays as saved, each laid out by it.
  """
  saved = _saved_tree(path)
  item = os.path.basename(path)
  if isinstance(target, jax.sharding.Sharding):
    target = jax.tree_util.tree_map(
        lambda x, s=target: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=s), saved)
  else:
    differences = tree_differences(saved, target)
    if differences:
      raise CheckpointMismatchError(f'{item}: {"; ".join(differences)}')
  try:
    return ocp.StandardCheckpointHandler().restore(epath.Path(path),
                                                   args=ocp.args.StandardRestore(target))
  except Exception as error:  # noqa: BLE001 - any failure to read the arrays is damage.
    raise DamagedCheckpointError(f'{item} unreadable ({_short(error)})') from None


def _verify(item: str, restored: Any, recorded: dict[str, str] | None) -> None:
  """DamagedCheckpointError if a restored array differs from its checksum at saving, or the
  meta lists checksums but none of this item's."""
  if recorded is None:
    raise DamagedCheckpointError(f'its meta has no checksums of {item}')
  actual = checksums(restored)
  wrong = sorted(k for k, v in recorded.items() if actual.get(k) != v)
  if wrong:
    raise DamagedCheckpointError(f'{item}: {len(wrong)} array(s) differ from their checksums '
                                 f'at saving (first: {wrong[0]})')


_MESSAGE_BYTES = 1024


def _agree(error: Exception | None) -> Exception | None:
  """One verdict for every process: the first process's error (None if none failed).

  A file that one host cannot read makes the checkpoint unusable for all: every process then
  skips it (or stops) together instead of waiting for the others in a collective.
  """
  if jax.process_count() == 1:
    return error
  kinds = (DamagedCheckpointError, CheckpointMismatchError)
  row = np.zeros(1 + _MESSAGE_BYTES, np.int32)
  if error is not None:
    text = str(error).encode('utf-8')[:_MESSAGE_BYTES]
    row[0] = 1 + kinds.index(type(error))
    row[1:1 + len(text)] = np.frombuffer(text, np.uint8)
  for process, (kind, *text) in enumerate(multihost_utils.process_allgather(row)):
    if kind:
      message = bytes(np.array(text, np.uint8)).rstrip(b'\0').decode('utf-8', 'replace')
      return kinds[kind - 1](message if process == jax.process_index() else
                             f'{message} (read by process {process})')
  return None


def read_checkpoint(path: str, targets: dict[str, Any],
                    step: int | None = None) -> dict[str, Any]:
  """Restores and verifies items of one checkpoint folder (a step's, or `averaged/`).

  Args:
    path: the checkpoint folder, holding one subfolder per item and `meta`.
    targets: item name -> an abstract tree to restore into (jax.ShapeDtypeStruct leaves with
      shardings; names and shapes must match), or a Sharding (the arrays as saved, laid out
      by it).
    step: if given, the step `meta` must record.
  Returns:
    {item: restored tree} for each target, and 'meta'.
  Raises:
    CheckpointMismatchError: the saved names or shapes differ from a target's.
    DamagedCheckpointError: files missing or unreadable, or an array whose checksum differs.
  """
  restored, error = {}, None
  try:
    restored['meta'] = _read_meta(path)
    if step is not None and restored['meta'].get('step', step) != step:
      raise DamagedCheckpointError(f'its meta records step {restored["meta"].get("step")}')
    for item, target in targets.items():
      restored[item] = _restore_item(os.path.join(path, item), target)
  except (DamagedCheckpointError, CheckpointMismatchError) as failure:
    error = failure
  error = _agree(error)  # Every process goes on, or raises, together.
  if error is not None:
    raise error
  recorded = restored['meta'].get('checksums')
  if recorded is None:
    legacy.warn_unverified(path)
    return restored
  for item in targets:
    _verify(item, restored[item], recorded.get(item))
  return restored


def saved_steps(workdir: str) -> list[int]:
  """The steps of the run's complete checkpoints, oldest first (orbax renames a checkpoint to
  its step number only once it is complete; set-aside ones are `N.damaged`)."""
  folder = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(folder):
    raise FileNotFoundError(f'No checkpoints in {folder}: is {workdir} a training workdir, and '
                            'has training saved a checkpoint yet?')
  return sorted(int(name) for name in os.listdir(folder)
                if name.isdigit() and os.path.isdir(os.path.join(folder, name)))


def step_path(workdir: str, step: int) -> str:
  return os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR, str(step)))


def restore_newest(workdir: str, read: Callable[[int], T], *, set_aside: bool = False,
                   steps: list[int] | None = None) -> tuple[int, T] | None:
  """(step, read(step)) for the newest checkpoint that `read` restores without damage.

  Each damaged checkpoint on the way gets a one-line warning; with `set_aside` (training) it is
  also renamed `N.damaged` so that later runs do not trip over it. Returns None when no
  checkpoint is intact. CheckpointMismatchError from `read` propagates: nothing is set aside.
  """
  for step in reversed(saved_steps(workdir) if steps is None else steps):
    try:
      return step, read(step)
    except DamagedCheckpointError as error:
      kept = _set_aside(workdir, step) if set_aside else step_path(workdir, step)
      logging.warning('Skipping damaged checkpoint %d (%s); trying the next older one. '
                      'Kept as %s.', step, error, kept)
  return None


def _set_aside(workdir: str, step: int) -> str:
  """Renames a damaged checkpoint out of the way (`N.damaged`, `N.damaged.2`, ...; nothing is
  ever deleted); returns its new path."""
  path = step_path(workdir, step)
  aside, number = f'{path}.damaged', 1
  while os.path.exists(aside):
    number += 1
    aside = f'{path}.damaged.{number}'
  if jax.process_index() == 0:
    os.rename(path, aside)
  if jax.process_count() > 1:  # Every host rescans only after process 0 has renamed it.
    multihost_utils.sync_global_devices(f'checkpoint {step} set aside')
  return aside


def restore_latest(workdir: str, abstract_params: Any, abstract_optimizer_state: Any,
                   abstract_ema: Any = None) -> tuple[Any, Any, dict[str, Any], Any] | None:
  """Training's restore: (params, optimizer_state, meta, ema) of the newest intact checkpoint in
  the given shapes and shardings, or None when there is none. `ema` is None unless
  `abstract_ema` is given and the checkpoint has one. Damaged ones are set aside;
  checkpoints that do not fit (another model or optimizer config) raise
  CheckpointMismatchError, naming the differences, and nothing is changed."""
  if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
    return None

  def read(step):
    targets = {'params': abstract_params, 'optimizer': abstract_optimizer_state}
    if abstract_ema is not None and os.path.isdir(os.path.join(step_path(workdir, step), 'ema')):
      targets['ema'] = abstract_ema
    try:
      restored = read_checkpoint(step_path(workdir, step), targets, step=step)
    except CheckpointMismatchError as error:
      cause = (' (optimizer settings such as grad_clip_norm or weight_decay change the layout '
               'of the optimizer state)' if str(error).startswith('optimizer') else '')
      raise CheckpointMismatchError(
          f'The checkpoints in {os.path.join(workdir, CHECKPOINT_DIR)} (newest: step {step}) '
          f'do not fit this config{cause}: {error}. Nothing was changed. Train with the config '
          'the run was made with (its config.json), or start a new --workdir; add '
          f'--init_params_from={workdir} there to start from these parameters with a fresh '
          'optimizer state.') from None
    return restored['params'], restored['optimizer'], restored['meta'], restored.get('ema')

  found = restore_newest(workdir, read, set_aside=True)
  return None if found is None else found[1]


def _local_sharding() -> jax.sharding.Sharding:
  """Every array whole on this process's first device (averaging works on host copies)."""
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def restore_params(workdir: str, step: int, target: Any = None) -> Any:
  """The verified params of checkpoint `step` into `target` (see `read_checkpoint`; default: one
  local device); DamagedCheckpointError if that checkpoint is damaged."""
  target = _local_sharding() if target is None else target
  return read_checkpoint(step_path(workdir, step), {'params': target}, step=step)['params']


def average_last(workdir: str, num_checkpoints: int) -> tuple[Any, list[int]]:
  """Element-wise mean (float32, host numpy) of the params of the newest intact checkpoints.

  Damaged checkpoints are skipped with a warning and the next older ones taken instead.
  """
  available = saved_steps(workdir)
  if not available:
    raise FileNotFoundError(f'No checkpoints in {workdir}/{CHECKPOINT_DIR}: train first.')
  total, steps = None, []
  while len(steps) < num_checkpoints:
    older = [s for s in available if not steps or s < steps[-1]]
    found = restore_newest(workdir, functools.partial(restore_params, workdir), steps=older)
    if found is None:
      break
    steps.append(found[0])
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), found[1])
    total = params if total is None else jax.tree_util.tree_map(np.add, total, params)
  if not steps:
    raise DamagedCheckpointError(f'No intact checkpoint in {workdir}/{CHECKPOINT_DIR} '
                                 f'(steps {available} are all damaged).')
  if len(steps) < num_checkpoints:
    logging.warning('Asked to average %d checkpoints; only %d intact ones exist (steps %s).',
                    num_checkpoints, len(steps), sorted(steps))
  averaged = jax.tree_util.tree_map(lambda x: (x / len(steps)).astype(np.float32), total)
  return averaged, sorted(steps)


def save_params_folder(workdir: str, name: str, params: Any, meta: dict[str, Any]) -> str:
  """Writes WORKDIR/NAME/ as one checkpoint item `params` plus `meta` with its checksums (as a
  training checkpoint), replacing what was there; returns the folder. Every process calls it
  with the same (global or host) parameters."""
  path = epath.Path(os.path.abspath(os.path.join(workdir, name)))
  if isinstance(jax.tree_util.tree_leaves(params)[0], np.ndarray):
    recorded = checksums(jax.device_put(params, _local_sharding()))
  else:
    recorded = checksums(params)
  meta = dict(meta, checksums={'params': recorded})
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(path, ocp.args.Composite(params=ocp.args.StandardSave(params),
                                             meta=ocp.args.JsonSave(meta)), force=True)
  return str(path)


def save_averaged(workdir: str, num_checkpoints: int) -> list[int]:
  """Averages the newest intact checkpoints into WORKDIR/averaged/ (params, and meta with
  their checksums, as in a training checkpoint)."""
  params, steps = average_last(workdir, num_checkpoints)
  path = save_params_folder(workdir, AVERAGED_DIR, params, {'averaged_steps': steps})
  logging.info('Averaged steps %s into %s.', steps, path)
  return steps


def _read_params_folder(workdir: str, name: str, target: Any) -> tuple[Any, dict[str, Any]]:
  """The params and meta of WORKDIR/averaged/ or WORKDIR/best/, verified."""
  path = os.path.abspath(os.path.join(workdir, name))
  if not os.path.isdir(path):
    how = (f'run `python average.py --workdir {workdir} --average_last N` first'
           if name == AVERAGED_DIR else 'train with eval.keep_best_metric set')
    raise FileNotFoundError(f'No {name} checkpoint at {path}: {how}.')
  try:
    if legacy.params_only_folder(path):
      return _restore_item(path, target), {}
    restored = read_checkpoint(path, {'params': target})
    return restored['params'], restored['meta']
  except DamagedCheckpointError as error:
    how = (f'average again with `python average.py --workdir {workdir}`'
           if name == AVERAGED_DIR else 'decode a step instead')
    raise DamagedCheckpointError(f'The {name} checkpoint {path} is damaged ({error}): '
                                 f'{how}.') from None


def newest_holds_ema(workdir: str) -> bool:
  """Whether the run's newest checkpoint holds a moving average of the parameters (the run
  was trained, or last resumed, with `optimizer.ema_decay`)."""
  steps = saved_steps(workdir)
  return bool(steps) and os.path.isdir(os.path.join(step_path(workdir, steps[-1]), 'ema'))


def _read_ema(workdir: str, target: Any) -> tuple[Any, str]:
  """The moving average of the newest intact checkpoint that has one."""
  with_ema = [s for s in saved_steps(workdir) if os.path.isdir(os.path.join(
      step_path(workdir, s), 'ema'))]
  if not with_ema:
    raise FileNotFoundError(f'No checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)} holds a '
                            'moving average of the parameters: train with optimizer.ema_decay.')
  found = restore_newest(workdir, lambda step: read_checkpoint(
      step_path(workdir, step), {'ema': target}, step=step)['ema'], steps=with_ema)
  if found is None:
    raise DamagedCheckpointError(f'Every checkpoint with a moving average in {workdir} is '
                                 f'damaged (steps {with_ema}).')
  return found[1], f'moving average at step {found[0]}'


def load_params(workdir: str, checkpoint: str | int | None = None, average: int = 0,
                target: Any = None) -> tuple[Any, str]:
  """Verified parameters (for decoding, or to start training from), and where they came from.

  Args:
    workdir: the training run's workdir.
    checkpoint: None = the newest intact checkpoint, a step number, 'averaged', 'best' (the
      best by the validation metric), or 'ema' (the newest moving average).
    average: if > 0, the mean of the newest `average` intact checkpoints instead.
    target: a Sharding to lay every array out by (default: one local device), or an abstract
      tree whose names and shapes the saved parameters must match (CheckpointMismatchError).
  Raises:
    FileNotFoundError: no such checkpoint. DamagedCheckpointError: the one asked for is damaged
    (or, for the newest, all are).
  """
  target = _local_sharding() if target is None else target
  if average > 0 and checkpoint is not None:
    raise ValueError(f'give a checkpoint ({checkpoint}) or a number of checkpoints to average '
                     f'({average}), not both.')
  if average > 0:
    params, steps = average_last(workdir, average)
    if isinstance(target, jax.sharding.Sharding):
      return jax.device_put(params, target), f'average of steps {steps}'
    differences = tree_differences(params, target)
    if differences:
      raise CheckpointMismatchError(f'params: {"; ".join(differences)}')
    return (jax.device_put(params, jax.tree_util.tree_map(lambda t: t.sharding, target)),
            f'average of steps {steps}')
  if checkpoint == AVERAGED_DIR:
    return (_read_params_folder(workdir, AVERAGED_DIR, target)[0],
            f'averaged checkpoint {workdir}/{AVERAGED_DIR}')
  if checkpoint == BEST_DIR:
    params, meta = _read_params_folder(workdir, BEST_DIR, target)
    return params, (f'best checkpoint (step {meta.get("step")}, {meta.get("metric")} '
                    f'{meta.get("value")})')
  checkpoint_dir = os.path.join(workdir, CHECKPOINT_DIR)
  steps = saved_steps(workdir)
  if not steps:
    raise FileNotFoundError(f'No checkpoints in {checkpoint_dir}: train first.')
  if checkpoint == 'ema':
    return _read_ema(workdir, target)
  if checkpoint is not None and not str(checkpoint).isdigit():
    raise ValueError(f"--checkpoint must be a step number or one of {list(NAMED_CHECKPOINTS)}, "
                     f'got {checkpoint!r}.')
  if checkpoint is None:
    found = restore_newest(workdir, lambda step: restore_params(workdir, step, target))
    if found is None:
      raise DamagedCheckpointError(f'Every checkpoint in {checkpoint_dir} is damaged '
                                   f'(steps {steps}).')
    return found[1], f'step {found[0]}'
  step = int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'No checkpoint at step {step} in {checkpoint_dir}; have {steps}.')
  try:
    return restore_params(workdir, step, target), f'step {step}'
  except DamagedCheckpointError as error:
    raise DamagedCheckpointError(f'Checkpoint {step} in {checkpoint_dir} is damaged ({error}); '
                                 f'choose another of {steps}.') from None

