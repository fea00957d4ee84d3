"""The device mesh and how arrays are laid out on it: shared by training, decoding and restores.

Training splits batch rows over every device (`data` x `fsdp` mesh axes) and keeps parameters
replicated, or, for models too large for one device, splits the large arrays over `fsdp`.
Decoding splits sentences over the devices of whatever machine it runs on; checkpoints are
restored straight into these layouts, so a run trained on N devices decodes and resumes on M.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'fsdp')
# Arrays with fewer elements stay replicated on an fsdp mesh: biases, LayerNorm scales, step
# counters and PRNG keys save little memory and would cost an all-gather each.
FSDP_MIN_SIZE = 1 << 16


class MeshError(ValueError):
  """A mesh_shape that does not describe the available devices."""


def make_mesh(mesh_shape: str = '', devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp') mesh over every device; mesh_shape like 'data:4,fsdp:2' ('' = all data).

  jax.make_mesh orders the devices by the hardware topology (rings on TPU slices).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {'data': -1, 'fsdp': 1}
  for part in filter(None, (p.strip() for p in mesh_shape.split(','))):
    name, _, size = part.partition(':')
    if name.strip() not in sizes or not size.strip().lstrip('-').isdigit():
      raise MeshError(f"mesh_shape must look like 'data:4,fsdp:2', got {mesh_shape!r}.")
    sizes[name.strip()] = int(size)
  if sizes['data'] == -1 and sizes['fsdp'] > 0:
    sizes['data'] = len(devices) // sizes['fsdp']
  if sizes['data'] * sizes['fsdp'] != len(devices) or min(sizes.values()) < 1:
    raise MeshError(f'mesh_shape {sizes} does not cover the {len(devices)} devices.')
  return jax.make_mesh((sizes['data'], sizes['fsdp']), MESH_AXES,
                       axis_types=(AxisType.Auto,) * 2, devices=devices)


def rows(mesh: Mesh) -> NamedSharding:
  """Leading (row) axis split over every device of the mesh, the rest whole."""
  return NamedSharding(mesh, P(mesh.axis_names))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def parameter_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
  """Replicated, or (fsdp > 1, at least FSDP_MIN_SIZE elements) split along the largest
  dimension the fsdp axis divides."""
  if fsdp_size > 1 and math.prod(shape) >= FSDP_MIN_SIZE:
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
      if shape[dim] % fsdp_size == 0 and shape[dim] >= fsdp_size:
        spec = [None] * len(shape)
        spec[dim] = 'fsdp'
        return P(*spec)
  return P()


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
  """The NamedSharding of every leaf of a (training) state tree on `mesh`."""
  fsdp_size = mesh.shape.get('fsdp', 1)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, parameter_spec(x.shape, fsdp_size)), abstract_state)


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs (of arrays or abstract values) carrying target shardings: what restores
  read into."""
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings)


def from_host_rows(local_rows: dict[str, np.ndarray], sharding: NamedSharding) -> dict:
  """This process's rows of a global batch -> global arrays split as `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_rows.items()}


def from_host_copy(batch: Any, sharding: NamedSharding) -> Any:
  """A batch (a pytree of arrays) every process holds in full -> global arrays split as
  `sharding`."""
  return jax.tree_util.tree_map(
      lambda v: jax.make_array_from_callback(v.shape, sharding, lambda index: v[index]), batch)


def one_program_in_flight(mesh: Mesh) -> bool:
  """Whether to wait for each multi-device program before dispatching the next.

  Several CPU devices in one process run collectives on a shared thread pool; with more than
  one such program in flight their all-reduces can wait on each other forever. GPUs and TPUs
  keep asynchronous dispatch.
  """
  return jax.default_backend() == 'cpu' and mesh.devices.size > 1
