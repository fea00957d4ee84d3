"""Starts project scripts as a cluster would: several processes, each with its own CPU devices.

Each process gets the environment a SLURM job step gives its tasks (`SLURM_JOB_ID`,
`SLURM_STEP_NODELIST=localhost`, `SLURM_NTASKS`, `SLURM_PROCID`, `SLURM_LOCALID`), which
`jax.distributed.initialize()` detects by itself, a free coordinator port
(`JAX_COORDINATOR_PORT`), gloo for the collectives between processes
(`JAX_CPU_COLLECTIVES_IMPLEMENTATION`) and `devices_per_process` fake CPU devices. Outputs go to
files (a full pipe would block a process), read back when the processes end.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Finished:
  """A process that ended: its exit code and what it printed."""
  returncode: int
  stdout: str
  stderr: str


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def xla_flags(devices: int) -> str:
  """This process's XLA_FLAGS (tests/conftest.py's) with `devices` CPU devices instead."""
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  return ' '.join([f'--xla_force_host_platform_device_count={devices}', *flags])


def process_env(devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
  """This process's environment with `devices` CPU devices and no inherited cluster settings."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('SLURM_', 'JAX_COORDINATOR'))}
  env.update(XLA_FLAGS=xla_flags(devices), TRANSFORMER_KEEP_MALLOC='1', PYTHONUNBUFFERED='1',
             **(extra or {}))
  return env


class Processes:
  """`python SCRIPT ARGS...` started as `num_processes` cooperating processes (one if 1 and
  not `distributed`: a plain single-process run)."""

  def __init__(self, script: str, *args: str, num_processes: int = 2,
               devices_per_process: int = 2, distributed: bool | None = None,
               env: dict[str, str] | None = None):
    distributed = num_processes > 1 if distributed is None else distributed
    self.logs = pathlib.Path(tempfile.mkdtemp(prefix='processes_'))
    cluster = {'SLURM_JOB_ID': str(os.getpid()), 'SLURM_STEP_NODELIST': 'localhost',
               'SLURM_NTASKS': str(num_processes), 'JAX_COORDINATOR_PORT': str(free_port()),
               'JAX_CPU_COLLECTIVES_IMPLEMENTATION': 'gloo'}
    command = [sys.executable, str(REPO / script), *args]
    if distributed:
      command.append('--distributed')
    self.popens = []
    for index in range(num_processes):
      extra = dict(env or {})
      if distributed:
        extra.update(cluster, SLURM_PROCID=str(index), SLURM_LOCALID=str(index))
      with open(self.logs / f'{index}.out', 'w') as out, open(self.logs / f'{index}.err',
                                                               'w') as err:
        self.popens.append(subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err,
                                            env=process_env(devices_per_process, extra)))
    self.started = time.time()

  def send(self, index: int, sig: int = signal.SIGTERM) -> None:
    self.popens[index].send_signal(sig)

  def stderr(self, index: int) -> str:
    return (self.logs / f'{index}.err').read_text(errors='replace')

  def wait(self, timeout: float = 600) -> list[Finished]:
    """Every process's outcome; kills them all and fails if any outlives `timeout` seconds."""
    deadline = self.started + timeout
    for popen in self.popens:
      try:
        popen.wait(timeout=max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        for other in self.popens:
          other.kill()
        logs = '\n'.join(f'--- process {i}:\n{self.stderr(i)[-3000:]}'
                         for i in range(len(self.popens)))
        raise AssertionError(f'processes still running after {timeout} s:\n{logs}') from None
    return [Finished(p.returncode, (self.logs / f'{i}.out').read_text(errors='replace'),
                     self.stderr(i)) for i, p in enumerate(self.popens)]


def run(script: str, *args: str, num_processes: int = 2, devices_per_process: int = 2,
        timeout: float = 600, env: dict[str, str] | None = None) -> list[Finished]:
  """Runs SCRIPT on `num_processes` processes and checks that every one exits with 0."""
  finished = Processes(script, *args, num_processes=num_processes,
                       devices_per_process=devices_per_process, env=env).wait(timeout)
  for index, result in enumerate(finished):
    assert result.returncode == 0, (f'{script} process {index} exited with '
                                    f'{result.returncode}:\n{result.stderr[-4000:]}')
  return finished


def wait_for(predicate, timeout: float, what: str, processes: Processes | None = None) -> None:
  """Polls `predicate` until it holds; fails after `timeout` seconds (or if a process ended)."""
  deadline = time.time() + timeout
  while not predicate():
    ended = [i for i, p in enumerate(processes.popens) if p.poll() is not None] \
        if processes else []
    if ended or time.time() > deadline:
      raise AssertionError(f'{what}: not after {timeout} s' if not ended else
                           f'{what}: process {ended[0]} ended first:\n'
                           f'{processes.stderr(ended[0])[-3000:]}')
    time.sleep(0.2)
