"""Fault injection: real train.py, decode.py and average.py processes against failures.

  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.fault_injection \
      [--output results.json] [--only kill9,sigterm,...] [--keep]

Trains one uninterrupted reference run (configs/tiny.py, 40 steps, a checkpoint every 10, all
kept, dropout 0.1), then runs each scenario in its own workdir with the reference's tokenizer
(so token ids match): kill -9, SIGTERM and SIGINT mid-run, a truncated, an overwritten and an
incomplete newest checkpoint, changed model and optimizer configs on resume, a second trainer,
a stale lock, a full disk (a small tmpfs; RLIMIT_FSIZE when mounting is not permitted),
metrics.jsonl after a kill, and bad decode flags. Each scenario checks its outcome from facts
(exit codes, stderr lines, which checkpoints exist and verify, final parameters against the
reference's) and becomes one row: what happened and whether data was lost. An expectation the
product does not meet is reported in its row (`UNEXPECTED: ...`), never raised. Prints a
markdown table and the wall time; `--output` also writes them as JSON with the machine.

Takes about 10 minutes on 2 cores. Run by hand (root is needed for the tmpfs), not in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from nmt import checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY = 40, 10  # The reference run: checkpoints 10, 20, 30, 40.
TRAIN_OVERRIDES = {
    'eval.bleu_sentences': '0', 'eval.every_steps': '100000', 'num_train_steps': str(STEPS),
    'checkpoint_every_steps': str(EVERY), 'keep_checkpoints': '10', 'model.dropout_rate': '0.1',
}
DECODE_SENTENCES = 8
TIMEOUT = 600  # Seconds any one process may take.
QUICK_EXIT_SECONDS = 20.0  # "Quickly" for the lock and flag errors: imports only, on a busy box.
# absl's hint after a flag error: advice, not a second error line.
ABSL_HINT = 'Pass --helpshort or --helpfull to see help on flags.'
# As tests/test_checkpoints.py: a file size limit from the third save on stands in for a full
# disk when mounting a tmpfs is not permitted (EFBIG instead of ENOSPC, the same handling).
FILL_DISK_AFTER_TWO_SAVES = '''
import resource, signal, sys
import train
from nmt import checkpoints
from absl import app

saved = []
original_save = checkpoints.save

def save(manager, step, *args, **kwargs):
  if len(saved) == 2:
    manager.wait_until_finished()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
  original_save(manager, step, *args, **kwargs)
  saved.append(step)

checkpoints.save = save
sys.argv = ['train.py'] + sys.argv[1:]
train.define_flags()
app.run(train.main, flags_parser=train.parse_flags)
'''


# ----------------------------------------------------------------------------- rows


class Row:
  """One scenario's result: facts, unmet expectations, and whether data was lost."""

  def __init__(self, name: str, title: str):
    self.name, self.title = name, title
    self.facts: list[str] = []
    self.problems: list[str] = []
    self.data_lost: bool | None = None  # None: could not be determined.
    self.seconds = 0.0

  def fact(self, text: str) -> None:
    self.facts.append(text)

  def expect(self, condition: bool, problem: str) -> bool:
    if not condition:
      self.problems.append(problem)
    return condition

  @property
  def outcome(self) -> str:
    facts = '; '.join(self.facts)
    if not self.problems:
      return facts
    return f'UNEXPECTED: {"; ".join(self.problems)}. Facts: {facts}'

  def as_json(self) -> dict[str, Any]:
    return {'name': self.name, 'scenario': self.title, 'outcome': self.outcome,
            'expectations_met': not self.problems, 'problems': self.problems,
            'facts': self.facts, 'data_lost': self.data_lost,
            'seconds': round(self.seconds, 1)}


@dataclasses.dataclass
class Result:
  """A finished process: exit code (None: timed out), its output, its wall time."""
  returncode: int | None
  stderr: str
  stdout: str
  seconds: float

  @property
  def last_line(self) -> str:
    lines = self.stderr.strip().splitlines()
    return lines[-1][:300] if lines else '(no stderr)'


# ----------------------------------------------------------------------------- processes


class Context:
  """The scratch folder, the processes' environment, and the reference run."""

  def __init__(self, root: str):
    self.root = root
    self.logs = os.path.join(root, 'logs')
    os.makedirs(self.logs)
    multi30k = os.environ.get('MULTI30K_DIR') or os.path.join(
        os.path.dirname(REPO), 'shared', 'data', 'multi30k')
    if not os.path.isfile(os.path.join(multi30k, 'train.en')):
      sys.exit(f'error: no Multi30k files in {multi30k}: set MULTI30K_DIR.')
    # TFDS prepares Multi30k under the scratch folder, never the user's ~/; one malloc setting
    # (no restart), so a signal reaches the trainer itself.
    self.env = {**os.environ, 'MULTI30K_DIR': os.path.abspath(multi30k),
                'TFDS_DATA_DIR': os.path.join(root, 'tfds'), 'TRANSFORMER_KEEP_MALLOC': '1'}
    self.reference = os.path.join(root, 'reference')
    self.source_file = os.path.join(root, 'sources.en')
    with open(os.path.join(multi30k, 'val.en'), encoding='utf-8') as f:
      lines = [next(f) for _ in range(DECODE_SENTENCES)]
    with open(self.source_file, 'w', encoding='utf-8') as f:
      f.writelines(lines)
    self.processes: list[subprocess.Popen] = []
    self.started: dict[int, float] = {}  # pid -> start time
    self._reference_params: dict[str, np.ndarray] | None = None
    self._translations: dict[int, list[str]] = {}

  def _log_path(self, label: str) -> str:
    return os.path.join(self.logs, f'{len(os.listdir(self.logs)):02d}_{label}.stderr')

  def run(self, command: list[str], label: str, timeout: float = TIMEOUT) -> Result:
    """Runs `command` in the repository to its end; its stderr is kept in logs/."""
    start = time.time()
    try:
      done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True,
                            timeout=timeout)
      result = Result(done.returncode, done.stderr, done.stdout, time.time() - start)
    except subprocess.TimeoutExpired as error:
      result = Result(None, _text(error.stderr), _text(error.stdout), time.time() - start)
    with open(self._log_path(label), 'w', encoding='utf-8') as f:
      f.write(result.stderr)
    return result

  def start(self, command: list[str], label: str) -> tuple[subprocess.Popen, str]:
    """Starts `command` in the background, its stderr going to a log file."""
    log = self._log_path(label)
    with open(log, 'w', encoding='utf-8') as f:
      process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                 stderr=f)
    self.started[process.pid] = time.time()
    self.processes.append(process)
    return process, log

  def finish(self, process: subprocess.Popen, log: str, timeout: float = TIMEOUT) -> Result:
    """Waits for a started process (kills it after `timeout`); its Result."""
    try:
      process.wait(timeout=timeout)
      returncode = process.returncode
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      returncode = None
    with open(log, encoding='utf-8', errors='replace') as f:
      stderr = f.read()
    return Result(returncode, stderr, '', time.time() - self.started[process.pid])

  def stop_leftovers(self) -> None:
    """Kills this script's processes that are still running (a scenario that broke off)."""
    for process in self.processes:
      if process.poll() is None:
        process.kill()
        process.wait()
    self.processes.clear()

  def workdir(self, name: str, tokenizer: bool = True) -> str:
    """A new workdir, with the reference's tokenizer unless told otherwise."""
    path = os.path.join(self.root, name)
    os.makedirs(path)
    if tokenizer:
      shutil.copy(os.path.join(self.reference, 'tokenizer.model'), path)
    return path

  def copy_of_reference(self, name: str) -> str:
    path = os.path.join(self.root, name)
    shutil.copytree(self.reference, path)
    return path

  def reference_params(self) -> dict[str, np.ndarray]:
    if self._reference_params is None:
      self._reference_params = flat_params(self.reference, STEPS)
    return self._reference_params

  def translations(self, step: int) -> list[str]:
    """The reference's translations of the source file with its intact checkpoint `step`."""
    if step not in self._translations:
      output = os.path.join(self.root, f'reference_step{step}.de')
      result = self.run(decode_command(self.reference, output, '--checkpoint', str(step),
                                       source=self.source_file), f'reference-decode-{step}')
      if result.returncode != 0:
        raise RuntimeError(f'decoding the reference at step {step} failed: {result.last_line}')
      self._translations[step] = read_lines(output)
    return self._translations[step]


def _text(output: str | bytes | None) -> str:
  return output.decode(errors='replace') if isinstance(output, bytes) else output or ''


def train_command(workdir: str, *flags: str, **overrides: str) -> list[str]:
  """train.py on configs/tiny.py with the reference's overrides, changed by `overrides`
  (keys with '.' written as '__', e.g. model__d_model='48'), then `flags`."""
  settings = dict(TRAIN_OVERRIDES, **{k.replace('__', '.'): v for k, v in overrides.items()})
  return [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', workdir,
          *(f'--config.{k}={v}' for k, v in settings.items()), *flags]


def decode_command(workdir: str, output: str, *flags: str, source: str) -> list[str]:
  return [sys.executable, 'decode.py', '--workdir', workdir, '--input', source, '--output',
          output, *flags]


def wait_until(predicate: Callable[[], bool], process: subprocess.Popen,
               timeout: float = TIMEOUT) -> bool:
  """Polls `predicate` until it holds (True), or the process ends or time runs out (False)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    if process.poll() is not None:
      return predicate()
    time.sleep(0.02)
  return False


# ----------------------------------------------------------------------------- facts


def read_lines(path: str) -> list[str]:
  with open(path, encoding='utf-8') as f:
    return f.read().split('\n')[:-1]


def checkpoint_dir(workdir: str, name: int | str = '') -> str:
  return os.path.join(workdir, checkpoints.CHECKPOINT_DIR, str(name))


def saved_steps(workdir: str) -> list[int]:
  try:
    return checkpoints.saved_steps(workdir)
  except FileNotFoundError:
    return []


def set_aside(workdir: str) -> list[str]:
  folder = checkpoint_dir(workdir)
  return sorted(n for n in os.listdir(folder) if '.damaged' in n) if os.path.isdir(folder) else []


def flat_params(workdir: str, step: int) -> dict[str, np.ndarray]:
  """Checkpoint `step`'s parameters, verified against their checksums, by path."""
  params = jax.device_get(checkpoints.restore_params(workdir, step))
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def final_equals_reference(ctx: Context, row: Row, workdir: str) -> bool:
  """Whether `workdir`'s checkpoint 40 equals the reference's (atol 1e-6); a fact either way."""
  if STEPS not in saved_steps(workdir):
    row.expect(False, f'no final checkpoint {STEPS} (have {saved_steps(workdir)})')
    return False
  try:
    got = flat_params(workdir, STEPS)
  except checkpoints.DamagedCheckpointError as error:
    row.expect(False, f'final checkpoint damaged: {error}')
    return False
  want = ctx.reference_params()
  if not row.expect(got.keys() == want.keys(), 'final params have other names than the reference'):
    return False
  difference = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
  same = difference <= 1e-6
  row.expect(same, f'final params differ from the uninterrupted run\'s (max abs diff '
             f'{difference:.2e})')
  if same:
    row.fact(f'final params equal the uninterrupted run\'s (max abs diff {difference:.0e})')
  return same


def steps_verify(row: Row, workdir: str, steps: list[int]) -> bool:
  """Whether each checkpoint in `steps` exists and restores with matching checksums."""
  bad = []
  for step in steps:
    try:
      checkpoints.restore_params(workdir, step)
    except Exception as error:  # noqa: BLE001 - any failure means this checkpoint is lost.
      bad.append(f'{step} ({type(error).__name__})')
  row.expect(not bad, f'checkpoints {", ".join(bad)} do not restore')
  return not bad


def resumed_from(stderr: str) -> int | None:
  found = re.findall(r'Resumed from step (\d+)\.', stderr)
  return int(found[-1]) if found else None


def error_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith('error:')]


def library_error_lines(stderr: str, allowed: str) -> list[str]:
  """absl ERROR lines (`E1123 ...`) that are not the run's own `allowed` message."""
  return [line for line in stderr.splitlines()
          if re.match(r'E\d{4} ', line) and allowed not in line]


def tracebacks(stderr: str) -> str | None:
  """None without a traceback; else how many, and whose frames they pass through."""
  count = stderr.count('Traceback (most recent call last)')
  if not count:
    return None
  frames = re.findall(r'File "([^"]+)"', stderr)
  if any(os.path.abspath(os.path.join(REPO, f)).startswith(REPO + os.sep)
         and f'{os.sep}site-packages{os.sep}' not in f for f in frames):  # The venv is in REPO.
    return f'{count}, through project code'
  if frames and all(f'{os.sep}asyncio{os.sep}' in f for f in frames):
    closed = ' "RuntimeError: Event loop is closed"' if 'Event loop is closed' in stderr else ''
    return f'{count}, asyncio frames only{closed}'
  return f'{count}, library frames only'


def check_clean(row: Row, result: Result, what: str) -> None:
  """No traceback in a process that is expected to end in one clear line."""
  kind = tracebacks(result.stderr)
  row.expect(kind is None, f'{what} printed tracebacks ({kind})')


def check_ok(row: Row, result: Result, what: str) -> bool:
  return row.expect(result.returncode == 0,
                    f'{what} exited {result.returncode}: {result.last_line}')


def train_rows(workdir: str) -> list[dict[str, Any]]:
  """metrics.jsonl's complete rows (a row torn by a kill is skipped)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    return []
  rows = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def row_kind(row: dict[str, Any]) -> str:
  if 'train_loss' in row:
    return 'train'
  if any(key.startswith('eval_') for key in row):
    return 'eval'
  return 'start' if 'num_params' in row else 'other'


def logged_train_steps(workdir: str) -> list[int]:
  return [r['step'] for r in train_rows(workdir) if row_kind(r) == 'train']


def snapshot(workdir: str) -> dict[str, tuple]:
  """Every file's (size, mtime, sha256) and every folder, by relative path."""
  state: dict[str, tuple] = {}
  for root, folders, files in os.walk(workdir):
    for name in folders:
      state[os.path.relpath(os.path.join(root, name), workdir) + '/'] = ('folder',)
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      stat = os.stat(path)
      state[os.path.relpath(path, workdir)] = (stat.st_size, stat.st_mtime_ns, digest)
  return state


def params_data_files(workdir: str, step: int) -> list[str]:
  """The files in folders named `d` under checkpoint `step`'s params (the arrays' bytes)."""
  folder = os.path.join(checkpoint_dir(workdir, step), 'params')
  return sorted(os.path.join(root, name) for root, _, names in os.walk(folder)
                for name in names if os.path.basename(root) == 'd')


def tmpfs_bytes(path: str) -> int:
  """What the files under `path` take on a tmpfs: each file's size rounded up to 4 KiB pages."""
  total = 0
  for root, _, names in os.walk(path):
    for name in names:
      total += -(-os.path.getsize(os.path.join(root, name)) // 4096) * 4096
  return total


# ----------------------------------------------------------------------------- scenarios


def kill9(ctx: Context, row: Row) -> None:
  workdir = ctx.workdir('kill9')
  process, log = ctx.start(train_command(workdir), 'kill9-first')
  reached = wait_until(lambda: os.path.isdir(checkpoint_dir(workdir, 20)), process)
  process.kill()
  first = ctx.finish(process, log)
  at_kill = saved_steps(workdir)
  if not row.expect(reached and first.returncode == -signal.SIGKILL,
                    f'no checkpoint 20 before the kill (exit {first.returncode}: '
                    f'{first.last_line})'):
    row.data_lost = None
    return
  row.fact(f'killed -9 with checkpoints {at_kill}')
  row.expect(STEPS not in at_kill, 'the run had finished before the kill')
  second = ctx.run(train_command(workdir), 'kill9-rerun')
  check_ok(row, second, 'the rerun')
  row.fact(f'rerun exit {second.returncode}, resumed from step {resumed_from(second.stderr)}')
  row.expect(resumed_from(second.stderr) == max(at_kill), 'the rerun did not resume from the '
             'newest checkpoint')
  row.data_lost = not final_equals_reference(ctx, row, workdir)


def interrupted(signum: signal.Signals) -> Callable[[Context, Row], None]:
  def scenario(ctx: Context, row: Row) -> None:
    workdir = ctx.workdir(signum.name.lower())
    process, log = ctx.start(train_command(workdir), f'{signum.name}-first')
    training = wait_until(lambda: bool(logged_train_steps(workdir)), process)
    process.send_signal(signum)
    first = ctx.finish(process, log)
    found = re.search(r'Stopped by signal at step (\d+)', first.stderr)
    stopped = int(found[1]) if found else None
    steps = saved_steps(workdir)
    row.fact(f'{signum.name} while training: exit {first.returncode}, stopped at step '
             f'{stopped}, checkpoints {steps}')
    row.expect(training, 'training never started')
    row.expect(first.returncode == 75, f'exit code {first.returncode}, not 75')
    saved_at_stop = row.expect(stopped is not None and stopped in steps,
                               'no checkpoint at the step it stopped')
    row.expect(stopped is None or stopped < STEPS, 'the signal came after the last step')
    check_clean(row, first, 'the interrupted run')
    second = ctx.run(train_command(workdir), f'{signum.name}-rerun')
    check_ok(row, second, 'the rerun')
    row.fact(f'rerun exit {second.returncode}, resumed from step {resumed_from(second.stderr)}')
    row.expect(stopped is None or resumed_from(second.stderr) == stopped,
               'the rerun did not resume from the step it stopped')
    same = final_equals_reference(ctx, row, workdir)
    row.data_lost = not (same and saved_at_stop)
  return scenario


def truncated(ctx: Context, row: Row) -> None:
  workdir = ctx.copy_of_reference('truncated')
  victim = max(params_data_files(workdir, STEPS), key=os.path.getsize)
  size = os.path.getsize(victim)
  os.truncate(victim, size // 2)
  row.fact(f'params data file of checkpoint {STEPS} cut from {size} to {size // 2} bytes')
  result = ctx.run(train_command(workdir), 'truncated-train')
  check_ok(row, result, 'training')
  warned = row.expect(f'Skipping damaged checkpoint {STEPS}' in result.stderr,
                      'no "Skipping damaged checkpoint" warning')
  kept = os.path.join(checkpoint_dir(workdir, f'{STEPS}.damaged'),
                      os.path.relpath(victim, checkpoint_dir(workdir, STEPS)))
  aside = row.expect(os.path.isfile(kept) and os.path.getsize(kept) == size // 2,
                     f'the damaged checkpoint is not kept as {STEPS}.damaged')
  resumed = resumed_from(result.stderr)
  row.expect(resumed == STEPS - EVERY, f'resumed from step {resumed}, not {STEPS - EVERY}')
  row.fact(f'warned: {"yes" if warned else "no"}, set aside: {set_aside(workdir)}, resumed from '
           f'step {resumed}, exit {result.returncode}')
  older = steps_verify(row, workdir, list(range(EVERY, STEPS, EVERY)))
  same = final_equals_reference(ctx, row, workdir)
  row.data_lost = not (same and older and aside)


def _decode_falls_back(ctx: Context, row: Row, workdir: str, label: str) -> bool:
  """decode.py on a workdir whose newest checkpoint is damaged: the older step, intact output."""
  output = os.path.join(ctx.root, f'{label}.de')
  result = ctx.run(decode_command(workdir, output, source=ctx.source_file), f'{label}-decode')
  if not check_ok(row, result, 'decode.py'):
    return False
  check_clean(row, result, 'decode.py')
  origin = re.search(r'Translating \d+ sentences with (.+?) \(beam', result.stderr)
  origin = origin[1] if origin else '?'
  older = STEPS - EVERY
  row.expect(origin == f'step {older}', f'decode.py used {origin}, not step {older}')
  row.expect(f'Skipping damaged checkpoint {STEPS}' in result.stderr,
             'decode.py gave no "Skipping damaged checkpoint" warning')
  lines = read_lines(output)
  same = row.expect(lines == ctx.translations(older),
                    f'decode.py\'s translations differ from intact step {older}\'s')
  distinct = len(set(lines))
  row.expect(distinct > 1, f'all {len(lines)} translations are identical')
  row.fact(f'decode.py exit 0 with {origin}, {distinct}/{len(lines)} distinct lines, '
           f'{"equal to" if same else "NOT equal to"} intact step {older}\'s')
  return same


def _training_sets_aside(ctx: Context, row: Row, workdir: str, label: str) -> bool:
  """Resumed training: warns, renames the newest N.damaged, finishes equal to the reference."""
  result = ctx.run(train_command(workdir), f'{label}-train')
  check_ok(row, result, 'training')
  check_clean(row, result, 'training')
  row.expect(f'Skipping damaged checkpoint {STEPS}' in result.stderr,
             'training gave no "Skipping damaged checkpoint" warning')
  aside = row.expect(f'{STEPS}.damaged' in set_aside(workdir),
                     f'training did not set checkpoint {STEPS} aside')
  resumed = resumed_from(result.stderr)
  row.expect(resumed == STEPS - EVERY, f'training resumed from step {resumed}')
  row.fact(f'training set aside {set_aside(workdir)}, resumed from step {resumed}, exit '
           f'{result.returncode}')
  older = steps_verify(row, workdir, list(range(EVERY, STEPS, EVERY)))
  return final_equals_reference(ctx, row, workdir) and aside and older


def overwritten(ctx: Context, row: Row) -> None:
  workdir = ctx.copy_of_reference('overwritten')
  files = params_data_files(workdir, STEPS)
  noise = np.random.default_rng(1)
  for path in files:  # 1,000 bytes in the middle of each, the size unchanged.
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
      f.seek(max(size // 2 - 500, 0))
      f.write(noise.integers(0, 256, min(size, 1000), np.uint8).tobytes())
    row.expect(os.path.getsize(path) == size, f'{path} changed size')
  row.fact(f'1,000 bytes overwritten in {len(files)} params data files of checkpoint {STEPS}')
  decoded = _decode_falls_back(ctx, row, workdir, 'overwritten')

  forced = ctx.run(decode_command(workdir, os.path.join(ctx.root, 'overwritten_forced.de'),
                                  '--checkpoint', str(STEPS), source=ctx.source_file),
                   'overwritten-decode-forced')
  clear = forced.last_line.startswith('error:') and 'damaged' in forced.last_line
  row.expect(forced.returncode not in (0, None) and clear,
             f'decode.py --checkpoint {STEPS}: exit {forced.returncode}, last line '
             f'"{forced.last_line[:80]}"')
  check_clean(row, forced, f'decode.py --checkpoint {STEPS}')
  row.fact(f'--checkpoint {STEPS}: exit {forced.returncode}, last line '
           f'{"is" if clear else "is not"} an error naming the damage')

  average = ctx.run([sys.executable, 'average.py', '--workdir', workdir, '--average_last',
                     '2'], 'overwritten-average')
  check_ok(row, average, 'average.py --average_last 2')
  row.expect(f'Skipping damaged checkpoint {STEPS}' in average.stderr,
             'averaging gave no "Skipping damaged checkpoint" warning')
  try:
    with open(os.path.join(workdir, checkpoints.AVERAGED_DIR, 'meta', 'metadata'),
              encoding='utf-8') as f:
      averaged = json.load(f)['averaged_steps']
  except (OSError, ValueError, KeyError) as error:
    averaged = f'unreadable ({error})'
  want = [STEPS - 2 * EVERY, STEPS - EVERY]
  row.expect(averaged == want, f'averaged steps {averaged}, not {want}')
  row.expect(STEPS in saved_steps(workdir) and not set_aside(workdir),
             'a reader renamed or removed the damaged checkpoint')
  row.fact(f'averaging took steps {averaged}')

  trained = _training_sets_aside(ctx, row, workdir, 'overwritten')
  row.data_lost = not (decoded and trained)


def missing_metadata(ctx: Context, row: Row) -> None:
  workdir = ctx.copy_of_reference('missing_metadata')
  os.remove(os.path.join(checkpoint_dir(workdir, STEPS), 'params', '_METADATA'))
  row.fact(f'params/_METADATA of checkpoint {STEPS} removed')
  decoded = _decode_falls_back(ctx, row, workdir, 'missing_metadata')
  row.expect(STEPS in saved_steps(workdir) and not set_aside(workdir),
             'decode.py renamed or removed the damaged checkpoint')
  trained = _training_sets_aside(ctx, row, workdir, 'missing_metadata')
  row.data_lost = not (decoded and trained)


def _changed_config(ctx: Context, row: Row, name: str, overrides: dict[str, str],
                    expected: str) -> str:
  """Resumes a copy of the reference with `overrides`: one error line matching `expected`,
  every file of the workdir unchanged. Returns the workdir."""
  workdir = ctx.copy_of_reference(name)
  before = snapshot(workdir)
  result = ctx.run(train_command(workdir, num_train_steps=str(STEPS + 20), **overrides),
                   f'{name}-resume')
  flags = ' '.join(f'--config.{k.replace("__", ".")}={v}' for k, v in overrides.items())
  errors = error_lines(result.stderr)
  row.expect(result.returncode not in (0, None), f'exit {result.returncode} with {flags}')
  row.expect(len(errors) == 1, f'{len(errors)} "error:" lines')
  row.expect(bool(errors) and re.search(expected, errors[0]) is not None,
             f'the error does not match {expected!r}: {errors[:1]}')
  check_clean(row, result, 'train.py')
  after = snapshot(workdir)
  changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
  row.expect(not changed, f'the workdir changed: {changed[:5]}')
  row.expect(not set_aside(workdir), f'renamed: {set_aside(workdir)}')
  quoted = errors[0] if errors else result.last_line
  shapes = re.findall(r'[\w/]+: (?:saved \([\d, ]*\), model \([\d, ]*\)|only in the \w+)', quoted)
  row.fact(f'{flags}: exit {result.returncode}, {len(errors)} error line naming '
           f'{"; ".join(shapes[:2]) or "?"}{" ..." if len(shapes) > 2 else ""}; '
           f'{len(before)} files and folders unchanged: {"yes" if not changed else "no"}')
  row.data_lost = any(before[k] != after.get(k) for k in before)  # Changed or gone.
  return workdir


def changed_model(ctx: Context, row: Row) -> None:
  _changed_config(ctx, row, 'changed_model', {'model__d_model': '48'},
                  r'saved \(.*32.*\), model \(.*48.*\)')


def changed_optimizer(ctx: Context, row: Row) -> None:
  old = _changed_config(ctx, row, 'changed_optimizer', {'optimizer__grad_clip_norm': '1.0'},
                        r'optimizer.*grad_clip_norm.*--init_params_from')
  lost = row.data_lost
  fresh = ctx.workdir('changed_optimizer_new', tokenizer=False)
  result = ctx.run(train_command(fresh, f'--init_params_from={old}', num_train_steps=str(EVERY),
                                 optimizer__grad_clip_norm='1.0'), 'changed_optimizer-init')
  check_ok(row, result, f'a new workdir with --init_params_from={old}')
  found = re.search(r'Parameters from \S+, (step \d+); fresh optimizer state', result.stderr)
  row.expect(found is not None and found[1] == f'step {STEPS}',
             f'the new run did not log parameters from step {STEPS}')
  tokenizers = []
  for workdir in (old, fresh):
    path = os.path.join(workdir, 'tokenizer.model')
    if os.path.isfile(path):
      with open(path, 'rb') as f:
        tokenizers.append(f.read())
  row.expect(len(tokenizers) == 2 and tokenizers[0] == tokenizers[1],
             'the new run has another tokenizer')
  verified = steps_verify(row, fresh, [EVERY])
  row.fact(f'new workdir with --init_params_from=OLD: exit {result.returncode}, '
           f'{found[1] if found else "?"} params, checkpoint {EVERY} '
           f'{"verifies" if verified else "missing"}')
  row.data_lost = lost


def second_trainer(ctx: Context, row: Row) -> None:
  workdir = ctx.workdir('second_trainer')
  lock = os.path.join(workdir, 'train.lock')
  first, log = ctx.start(train_command(workdir), 'second_trainer-first')
  locked = wait_until(lambda: os.path.isfile(lock), first)
  second = ctx.run(train_command(workdir), 'second_trainer-second')
  first_running = first.poll() is None
  errors = error_lines(second.stderr)
  row.expect(locked, 'the first trainer never took the lock')
  row.expect(first_running, 'the first trainer had ended before the second one did: '
             'inconclusive')
  row.expect(second.returncode not in (0, None), f'second trainer exit {second.returncode}')
  row.expect(len(errors) == 1 and 'train.lock' in errors[0],
             f'second trainer\'s error lines do not name the lock: {errors[:2]}')
  row.expect(second.seconds < QUICK_EXIT_SECONDS, f'second trainer took {second.seconds:.0f} s')
  check_clean(row, second, 'the second trainer')
  holder = re.search(r'held by (pid \d+)', errors[0]) if errors else None
  row.fact(f'second trainer: exit {second.returncode} after {second.seconds:.1f} s, '
           f'"{holder[0] if holder else "?"}" (the first\'s pid {first.pid}); first still '
           f'running then: {"yes" if first_running else "no"}')
  result = ctx.finish(first, log)
  check_ok(row, result, 'the first trainer')
  row.fact(f'first trainer exit {result.returncode}')
  row.data_lost = not final_equals_reference(ctx, row, workdir)


def stale_lock(ctx: Context, row: Row) -> None:
  workdir = ctx.workdir('stale_lock')
  lock = os.path.join(workdir, 'train.lock')
  process, log = ctx.start(train_command(workdir), 'stale_lock-first')
  reached = wait_until(lambda: os.path.isdir(checkpoint_dir(workdir, EVERY)), process)
  process.kill()
  ctx.finish(process, log)
  try:
    with open(lock, encoding='utf-8') as f:
      holder = json.load(f).get('pid')
  except (OSError, ValueError):
    holder = None
  row.expect(reached, f'no checkpoint {EVERY} before the kill')
  row.expect(holder == process.pid, f'no stale train.lock of pid {process.pid} after the kill')
  row.fact(f'killed -9 (pid {process.pid}) with checkpoints {saved_steps(workdir)}, train.lock '
           f'{"left" if holder == process.pid else "absent"}')
  result = ctx.run(train_command(workdir), 'stale_lock-rerun')
  check_ok(row, result, 'the restart')
  took_over = row.expect('Taking over the stale lock' in result.stderr,
                         'no "Taking over the stale lock" warning')
  row.expect(not os.path.exists(lock), 'train.lock left after the restart ended')
  row.fact(f'restart: exit {result.returncode}, took over the lock: '
           f'{"yes" if took_over else "no"}, resumed from step {resumed_from(result.stderr)}')
  row.data_lost = not final_equals_reference(ctx, row, workdir)


def _mount(*args: str) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(['mount', *args], capture_output=True, text=True)
  except OSError as error:  # No mount command.
    return subprocess.CompletedProcess(['mount', *args], 1, '', str(error))


def disk_full(ctx: Context, row: Row) -> None:
  mount_point = os.path.join(ctx.root, 'tmpfs')
  os.makedirs(mount_point)
  checkpoint_bytes = max(tmpfs_bytes(checkpoint_dir(ctx.reference, s))
                         for s in saved_steps(ctx.reference))
  # The tokenizer, config, lock, metrics and TensorBoard files, then two checkpoints and half
  # of a third: the save at step 30 runs out of room.
  size_k = (64 * 1024 + 2 * checkpoint_bytes + checkpoint_bytes // 2) // 1024
  mounted = _mount('-t', 'tmpfs', '-o', f'size={size_k}k', 'tmpfs', mount_point)
  try:
    if mounted.returncode == 0:
      workdir = os.path.join(mount_point, 'run')
      os.makedirs(workdir)
      shutil.copy(os.path.join(ctx.reference, 'tokenizer.model'), workdir)
      row.fact(f'tmpfs of {size_k} KiB (one checkpoint: {checkpoint_bytes // 1024} KiB)')
      command = train_command(workdir)
    else:
      workdir = ctx.workdir('disk_full')
      row.fact(f'mount not permitted ({mounted.stderr.strip()[:80]}): RLIMIT_FSIZE stand-in '
               'after two checkpoints (EFBIG, not a real full disk)')
      command = [sys.executable, '-c', FILL_DISK_AFTER_TWO_SAVES, *train_command(workdir)[2:]]
    full = ctx.run(command, 'disk_full-first')
    lines = full.stderr.strip().splitlines()
    last = lines[-1] if lines else ''
    before = saved_steps(workdir)
    row.expect(full.returncode == 1, f'exit {full.returncode}, not 1')
    row.expect(last.startswith('error: no space left'), f'last stderr line: {last[:200]}')
    newest = re.search(r'newest: step (\d+)', last)
    row.expect(bool(before) and newest is not None and int(newest[1]) == before[-1],
               f'the error does not name the newest checkpoint {before[-1:]}')
    library = library_error_lines(full.stderr, 'no space left')
    row.expect(not library, f'{len(library)} library error lines, first: {library[:1]}')
    kind = tracebacks(full.stderr)
    check_clean(row, full, 'the full-disk run')
    row.expect(bool(before) and before[-1] < STEPS, f'checkpoints {before}: the disk never '
               'filled (inconclusive)')
    intact = steps_verify(row, workdir, before)
    row.fact(f'exit {full.returncode}, last line "{last[:60]}...", library error lines: '
             f'{len(library)}, tracebacks: {kind or "none"}; checkpoints {before} verify: '
             f'{"yes" if intact else "no"}')

    if mounted.returncode == 0:
      remounted = _mount('-o', 'remount,size=64m', mount_point)
      row.expect(remounted.returncode == 0, f'remount failed: {remounted.stderr.strip()}')
    rerun = ctx.run(train_command(workdir), 'disk_full-rerun')
    check_ok(row, rerun, 'the rerun with room')
    resumed = resumed_from(rerun.stderr)
    row.expect(bool(before) and resumed == before[-1],
               f'the rerun resumed from step {resumed}, not {before[-1:]}')
    row.fact(f'with room: exit {rerun.returncode}, resumed from step {resumed}')
    same = final_equals_reference(ctx, row, workdir)
    row.data_lost = not (intact and same)
  finally:
    if mounted.returncode == 0:
      if subprocess.run(['umount', mount_point], capture_output=True).returncode != 0:
        subprocess.run(['umount', '-l', mount_point], capture_output=True)


def metrics_after_kill(ctx: Context, row: Row) -> None:
  workdir = ctx.workdir('metrics')

  def logged_past_a_checkpoint() -> bool:
    steps = saved_steps(workdir)
    return bool(steps) and any(s > steps[-1] for s in logged_train_steps(workdir))

  process, log = ctx.start(train_command(workdir), 'metrics-first')
  reached = wait_until(logged_past_a_checkpoint, process)
  process.kill()
  ctx.finish(process, log)
  at_kill, logged = saved_steps(workdir), logged_train_steps(workdir)
  row.expect(reached, 'no row logged after a checkpoint before the kill')
  row.fact(f'killed -9 with checkpoints {at_kill}, train rows logged up to step '
           f'{max(logged, default=None)}')
  result = ctx.run(train_command(workdir), 'metrics-rerun')
  check_ok(row, result, 'the rerun')
  path = os.path.join(workdir, 'metrics.jsonl')
  with open(path, encoding='utf-8') as f:
    lines = f.read().splitlines()
  rows = train_rows(workdir)
  row.expect(len(rows) == len(lines), f'{len(lines) - len(rows)} torn lines')
  keys = [(r.get('step'), row_kind(r)) for r in rows]
  duplicates = sorted({k for k in keys if keys.count(k) > 1})
  row.expect(not duplicates, f'rows written twice: {duplicates}')
  train_steps = [s for s, kind in keys if kind == 'train']
  want = sorted({(r.get('step'), row_kind(r)) for r in train_rows(ctx.reference)})
  missing = sorted(set(want) - set(keys))
  extra = sorted(set(keys) - set(want))
  row.expect(not missing and not extra, f'rows missing {missing}, extra {extra} against the '
             'uninterrupted run')
  row.expect(train_steps == sorted(set(train_steps)), 'train rows out of order')
  row.fact(f'after the rerun: {len(rows)} rows, train steps {train_steps[0]}..{train_steps[-1]} '
           f'each once: {"yes" if not duplicates else "no"}, same (step, kind) rows as the '
           f'uninterrupted run: {"yes" if not missing and not extra else "no"}'
           if train_steps else 'after the rerun: no train rows')
  row.data_lost = bool(missing)


def decode_flags(ctx: Context, row: Row) -> None:
  cases = (('--beam_size', '0'), ('--nbest', '0'), ('--nbest', '5', '--beam_size', '2'),
           ('--output', '/no/such/dir/x'))
  lost = False
  for flags in cases:
    previous = os.path.join(ctx.root, 'previous.de')
    with open(previous, 'w', encoding='utf-8') as f:
      f.write('translations of an earlier run\n')
    output = [] if '--output' in flags else ['--output', previous]
    command = [sys.executable, 'decode.py', '--workdir', ctx.reference, '--input',
               ctx.source_file, *output, *flags]
    result = ctx.run(command, 'decode_flags')
    text = ' '.join(flags)
    lines = [line for line in result.stderr.splitlines() if line.strip() and line != ABSL_HINT]
    row.expect(result.returncode not in (0, None), f'{text}: exit {result.returncode}')
    row.expect(len(lines) == 1, f'{text}: {len(lines)} stderr lines, not one (last: '
               f'"{lines[-1][:90] if lines else ""}")')
    check_clean(row, result, text)
    row.expect(result.seconds < QUICK_EXIT_SECONDS, f'{text}: took {result.seconds:.0f} s')
    with open(previous, encoding='utf-8') as f:
      kept = f.read() == 'translations of an earlier run\n'
    lost |= not kept
    row.expect(kept, f'{text}: overwrote the existing --output file')
    row.fact(f'{text}: exit {result.returncode}, {len(lines)} line(s), {result.seconds:.1f} s')
  row.data_lost = lost


SCENARIOS: list[tuple[str, str, Callable[[Context, Row], None]]] = [
    ('kill9', 'kill -9 after checkpoint 20, rerun', kill9),
    ('sigterm', 'SIGTERM mid-run, rerun', interrupted(signal.SIGTERM)),
    ('sigint', 'SIGINT mid-run, rerun', interrupted(signal.SIGINT)),
    ('truncated', 'newest checkpoint: a params data file cut to half, resume', truncated),
    ('overwritten', 'newest checkpoint: 1,000 bytes overwritten in each params data file; '
     'decode, average, resume', overwritten),
    ('missing_metadata', 'newest checkpoint without params/_METADATA; decode, resume',
     missing_metadata),
    ('changed_model', 'resume with --config.model.d_model=48', changed_model),
    ('changed_optimizer', 'resume with --config.optimizer.grad_clip_norm=1.0, then '
     '--init_params_from in a new workdir', changed_optimizer),
    ('second_trainer', 'a second train.py on a workdir in use', second_trainer),
    ('stale_lock', 'restart after kill -9 left train.lock', stale_lock),
    ('disk_full', 'disk full at the third checkpoint, rerun with room', disk_full),
    ('metrics', 'metrics.jsonl after kill -9 and resume', metrics_after_kill),
    ('decode_flags', 'bad decode.py flags', decode_flags),
]


# ----------------------------------------------------------------------------- the run


def train_reference(ctx: Context) -> None:
  """The uninterrupted run every scenario compares with (it trains the shared tokenizer)."""
  result = ctx.run(train_command(ctx.reference), 'reference')
  steps = saved_steps(ctx.reference)
  if result.returncode != 0 or steps != list(range(EVERY, STEPS + 1, EVERY)):
    sys.exit(f'error: the reference run failed (exit {result.returncode}, checkpoints {steps}): '
             f'{result.last_line}')
  print(f'reference run: {STEPS} steps, checkpoints {steps}, {result.seconds:.0f} s', flush=True)


def run_scenario(ctx: Context, name: str, title: str,
                 scenario: Callable[[Context, Row], None]) -> Row:
  row = Row(name, title)
  start = time.time()
  try:
    scenario(ctx, row)
  except Exception as error:  # noqa: BLE001 - a broken scenario is a row, not the end.
    row.expect(False, f'the scenario broke off: {type(error).__name__}: {error}')
    row.data_lost = None
  finally:
    ctx.stop_leftovers()
  row.seconds = time.time() - start
  return row


def machine() -> dict[str, Any]:
  cpu = platform.processor() or 'unknown'
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')),
                 cpu)
  except OSError:
    pass
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
  return {'cpu': cpu, 'cores': len(os.sched_getaffinity(0)),
          'date': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
          'python': platform.python_version(), 'jax': jax.__version__, 'commit': commit}


def markdown_table(rows: list[Row]) -> str:
  def cell(text: str) -> str:
    return text.replace('|', '\\|').replace('\n', ' ')

  lines = ['| scenario | outcome | data lost |', '|---|---|---|']
  for row in rows:
    lost = {True: 'yes', False: 'no', None: 'unknown'}[row.data_lost]
    lines.append(f'| {cell(row.name)}: {cell(row.title)} | {cell(row.outcome)} | {lost} |')
  return '\n'.join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--output', '--json', dest='output', default='',
                      help='Also write the rows and the machine here as JSON.')
  parser.add_argument('--only', default='', help='Comma-separated scenario names: '
                      + ', '.join(name for name, _, _ in SCENARIOS))
  parser.add_argument('--keep', action='store_true', help='Keep the scratch folder (workdirs, '
                      'every process\'s stderr) and print where it is.')
  args = parser.parse_args(argv)
  names = [name for name in args.only.split(',') if name]
  unknown = sorted(set(names) - {name for name, _, _ in SCENARIOS})
  if unknown:
    parser.error(f'--only: no scenario {", ".join(unknown)}')
  args.names = names or [name for name, _, _ in SCENARIOS]
  return args


def main(argv: list[str] | None = None) -> list[Row]:
  args = parse_args(argv)
  logging.set_verbosity(logging.ERROR)  # This process only reads checkpoints.
  start = time.time()
  root = tempfile.mkdtemp(prefix='fault_injection_')
  rows = []
  try:
    ctx = Context(root)
    train_reference(ctx)
    for name, title, scenario in SCENARIOS:
      if name in args.names:
        rows.append(run_scenario(ctx, name, title, scenario))
        row = rows[-1]
        lost = {True: 'yes', False: 'no', None: 'unknown'}[row.data_lost]
        print(f'{name}: {"ok" if not row.problems else "UNEXPECTED"}, data lost: {lost} '
              f'({row.seconds:.0f} s)', flush=True)
  finally:
    if args.keep:
      print(f'scratch folder kept: {root}')
    else:
      shutil.rmtree(root, ignore_errors=True)
  wall = time.time() - start
  print()
  print(markdown_table(rows))
  print(f'\nwall time: {wall:.0f} s ({wall / 60:.1f} min)')
  if args.output:
    with open(args.output, 'w', encoding='utf-8') as f:
      json.dump({'command': ' '.join(['python', '-m', 'benchmarks.fault_injection',
                                      *(sys.argv[1:] if argv is None else argv)]),
                 'machine': machine(), 'wall_seconds': round(wall, 1),
                 'rows': [row.as_json() for row in rows]}, f, indent=2)
  return rows


if __name__ == '__main__':
  main()
