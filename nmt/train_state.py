"""The training state a run starts from: the newest intact checkpoint of its workdir, or fresh
parameters (or another run's, `--init_params_from`) with a fresh optimizer state."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from model import Transformer
from nmt import checkpoints, sharding
from nmt.config_check import ConfigError
from nmt.optimization import init_train_state


def restore_or_init(config: ml_collections.ConfigDict, model: Transformer,
                    optimizer: optax.GradientTransformation, mesh: Mesh, workdir: str,
                    init_params_from: str | None = None):
  """The training state on `mesh`: from the newest intact checkpoint, or fresh.

  A fresh state takes its parameters from `init_params_from` when given ('RUN_DIR' or
  'RUN_DIR:CHECKPOINT', `checkpoints.split_run_checkpoint`; its optimizer state and step start
  anew).
  Returns (state, its shardings, the restored checkpoint's meta or None when fresh).
  """
  ema = config.optimizer.ema_decay > 0
  init_state = functools.partial(init_train_state, model, optimizer, ema=ema)
  rng = jax.random.PRNGKey(config.seed)
  shardings = sharding.state_shardings(jax.eval_shape(init_state, rng), mesh)
  state = jax.jit(init_state, out_shardings=shardings)(rng)
  optimizer_keys = ('opt_state', 'rng')
  abstract_params = sharding.with_shardings(state['params'], shardings['params'])
  restored = checkpoints.restore_latest(
      workdir, abstract_params,
      sharding.with_shardings({k: state[k] for k in optimizer_keys},
                              {k: shardings[k] for k in optimizer_keys}),
      abstract_ema=abstract_params if ema else None)
  if restored is None:
    if init_params_from:
      run, checkpoint = checkpoints.split_run_checkpoint(init_params_from)
      try:
        state['params'], origin = checkpoints.load_params(run, checkpoint, target=abstract_params)
      except checkpoints.CheckpointMismatchError as error:
        raise checkpoints.CheckpointMismatchError(
            f'--init_params_from={init_params_from}: its parameters do not fit this config\'s '
            f'model ({error}).') from None
      logging.info('Parameters from %s, %s; fresh optimizer state.', run, origin)
    return state, shardings, None
  if init_params_from:
    logging.warning('%s has checkpoints: resuming them; --init_params_from is ignored.', workdir)
  params, optimizer_item, meta, ema_params = restored
  state.update(params=params, **optimizer_item, step=np.int32(meta['step']),
               nonfinite_total=np.int32(meta.get('nonfinite_total', 0)),
               nonfinite_in_a_row=np.int32(meta.get('nonfinite_in_a_row', 0)))
  if ema:
    if ema_params is None:
      logging.warning('Checkpoint %d has no moving average (it was saved without '
                      'optimizer.ema_decay): the average starts from its parameters.',
                      meta['step'])
      ema_params = jax.tree_util.tree_map(jnp.copy, params)
    state['ema_params'] = ema_params
  logging.info('Resumed from step %d.', meta['step'])
  # Every array on its training layout, placed here (the step's transfer guard allows none).
  return jax.device_put(state, shardings), shardings, meta


def whole_data_state(train_iter: Any) -> dict[str, Any]:
  """The training data's state of every shard: each process holds its own shards' (JSON), so
  with several processes every process gathers the others'."""
  state = train_iter.get_state()
  if jax.process_count() > 1:
    mine = np.frombuffer(json.dumps(state['shards']).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([len(mine)], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:len(mine)] = mine
    shards = {}
    for row, size in zip(multihost_utils.process_allgather(padded), sizes.tolist()):
      shards.update(json.loads(bytes(row[:size])))
    state = dict(state, shards=shards)
  return state


def copy_tokenizer(init_params_from: str, workdir: str) -> None:
  """Gives `workdir` the tokenizer of the run its parameters come from (their vocabulary):
  `init_params_from` is 'RUN_DIR' or 'RUN_DIR:CHECKPOINT'."""
  source_run, _ = checkpoints.split_run_checkpoint(init_params_from)
  source = os.path.join(source_run, 'tokenizer.model')
  target = os.path.join(workdir, 'tokenizer.model')
  if not os.path.isfile(source):
    raise FileNotFoundError(f'{source} not found: --init_params_from must name a training '
                            'workdir, optionally followed by :STEP or :' +
                            ', :'.join(checkpoints.NAMED_CHECKPOINTS) + '.')
  with open(source, 'rb') as f:
    tokenizer = f.read()
  if os.path.isfile(target):
    with open(target, 'rb') as f:
      if f.read() != tokenizer:
        raise ConfigError(f'{target} differs from {source}: parameters from another run need '
                          'its vocabulary; use a new --workdir.')
    return
  if jax.process_index() == 0:
    tmp = f'{target}.tmp{os.getpid()}'
    with open(tmp, 'wb') as f:
      f.write(tokenizer)
    os.replace(tmp, target)
