"""The workdir lock: one holder, stale locks taken over, a race with one winner, train.py refuses.

Before workdir_lock.py, nothing stopped a second trainer on a running trainer's workdir.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from nmt import workdir_lock
from nmt.workdir_lock import WorkdirLock, WorkdirLockedError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_lock(workdir, **fields) -> str:
  """Writes WORKDIR/train.lock as another holder would: this host and pid unless `fields` say."""
  now = time.time()
  holder = {'host': socket.gethostname(), 'pid': os.getpid(),
            'start_time': workdir_lock.process_start_time(os.getpid()), 'created': now,
            'heartbeat': now, 'token': uuid.uuid4().hex, **fields}
  path = os.path.join(workdir, workdir_lock.LOCK_NAME)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(holder, f)
  return path


def read_lock(workdir) -> dict:
  with open(os.path.join(workdir, workdir_lock.LOCK_NAME), encoding='utf-8') as f:
    return json.load(f)


def dead_pid() -> int:
  """The pid of a process that has exited (and been reaped)."""
  process = subprocess.Popen(['true'])
  process.wait()
  return process.pid


def takeover_warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if 'Taking over the stale lock' in r.getMessage()]


def test_acquire_writes_the_holder_release_removes_it_and_it_can_be_taken_again(tmp_path):
  """The lock file names this host, pid and start time; release removes it; idempotent."""
  lock = WorkdirLock(str(tmp_path))
  with lock:
    holder = read_lock(tmp_path)
    assert holder['host'] == socket.gethostname() and holder['pid'] == os.getpid()
    assert holder['start_time'] == workdir_lock.process_start_time(os.getpid()) is not None
    assert holder['created'] == holder['heartbeat'] <= time.time()
    assert os.listdir(tmp_path) == ['train.lock']  # No temporary file left.
  assert not os.listdir(tmp_path)
  lock.release()  # Idempotent.
  with WorkdirLock(str(tmp_path)):
    assert read_lock(tmp_path)['pid'] == os.getpid()
  assert not os.listdir(tmp_path)


def test_an_exception_inside_the_with_block_releases_the_lock(tmp_path):
  """__exit__ releases on exceptions too, so a failed run leaves no lock behind."""
  with pytest.raises(ValueError, match='boom'), WorkdirLock(str(tmp_path)):
    raise ValueError('boom')
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('holder', ['this process', 'a sleep subprocess'])
def test_a_live_holder_on_this_host_is_never_taken_over(tmp_path, holder):
  """A second acquire while a live process holds the lock raises one line naming pid and path."""
  if holder == 'this process':
    first = WorkdirLock(str(tmp_path)).acquire()
    pid = os.getpid()
  else:
    sleeper = subprocess.Popen(['sleep', '60'])
    pid = sleeper.pid
    while workdir_lock.process_start_time(pid) is None:  # Present in /proc as soon as forked.
      time.sleep(0.01)
    write_lock(str(tmp_path), pid=pid, start_time=workdir_lock.process_start_time(pid))
  try:
    before = read_lock(tmp_path)
    with pytest.raises(WorkdirLockedError) as raised:
      WorkdirLock(str(tmp_path)).acquire()
    message = str(raised.value)
    assert '\n' not in message
    assert f'pid {pid} on host {socket.gethostname()}' in message
    assert str(tmp_path / 'train.lock') in message and '--workdir' in message
    assert read_lock(tmp_path) == before  # Untouched.
  finally:
    if holder == 'this process':
      first.release()
    else:
      sleeper.kill()
      sleeper.wait()


def test_the_lock_of_a_dead_pid_is_taken_over_with_one_warning(tmp_path, caplog):
  """Same host, pid no longer running: stale; the warning names the old holder."""
  pid = dead_pid()
  write_lock(str(tmp_path), pid=pid, start_time=12345)
  with WorkdirLock(str(tmp_path)):
    assert read_lock(tmp_path)['pid'] == os.getpid()
  [warning] = takeover_warnings(caplog)
  assert f'pid {pid} on host {socket.gethostname()}' in warning and 'not running' in warning
  assert not os.listdir(tmp_path)  # No claim file left.


def test_a_reused_pid_is_stale(tmp_path, caplog):
  """Same host, the pid runs but started at another time: another process has the pid now."""
  start_time = workdir_lock.process_start_time(os.getpid())
  write_lock(str(tmp_path), start_time=start_time + 1)
  with WorkdirLock(str(tmp_path)):
    assert read_lock(tmp_path)['start_time'] == start_time
  [warning] = takeover_warnings(caplog)
  assert 'another process' in warning


@pytest.mark.parametrize('heartbeat_age, stale', [(workdir_lock.STALE_AFTER_SECONDS + 5, True),
                                                  (5.0, False)])
def test_another_hosts_lock_is_stale_only_when_its_heartbeat_is_old(tmp_path, caplog,
                                                                    heartbeat_age, stale):
  """Another host's pid cannot be checked: its heartbeat's age decides."""
  now = time.time()
  write_lock(str(tmp_path), host='another-host.invalid', pid=1, created=now - 3600,
             heartbeat=now - heartbeat_age)
  if stale:
    with WorkdirLock(str(tmp_path)):
      assert read_lock(tmp_path)['host'] == socket.gethostname()
    [warning] = takeover_warnings(caplog)
    assert 'pid 1 on host another-host.invalid' in warning and 'heartbeat' in warning
  else:
    with pytest.raises(WorkdirLockedError, match='pid 1 on host another-host.invalid'):
      WorkdirLock(str(tmp_path)).acquire()
    assert read_lock(tmp_path)['host'] == 'another-host.invalid'
    assert not takeover_warnings(caplog)


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
  """If another trainer took the lock over, release does not delete that trainer's lock."""
  lock = WorkdirLock(str(tmp_path)).acquire()
  write_lock(str(tmp_path), host='another-host.invalid')
  lock.release()
  assert read_lock(tmp_path)['host'] == 'another-host.invalid'


def test_the_heartbeat_advances_while_held_and_stops_on_release(tmp_path):
  """A daemon thread rewrites the heartbeat time (the rest unchanged) until release."""
  lock = WorkdirLock(str(tmp_path), heartbeat_seconds=0.02).acquire()
  first = read_lock(tmp_path)
  deadline = time.time() + 10
  while read_lock(tmp_path)['heartbeat'] == first['heartbeat'] and time.time() < deadline:
    time.sleep(0.01)
  later = read_lock(tmp_path)
  assert later['heartbeat'] > first['heartbeat']
  assert {**later, 'heartbeat': None} == {**first, 'heartbeat': None}
  lock.release()
  assert not lock._heartbeat.is_alive() and not os.listdir(tmp_path)


@pytest.mark.parametrize('existing', [None, 'stale'])
def test_concurrent_threads_exactly_one_wins(tmp_path, caplog, existing):
  """Starters that acquire at once, on a free or a stale lock: one wins, one takeover warning."""
  for _ in range(10):
    caplog.clear()
    if existing == 'stale':
      write_lock(str(tmp_path), pid=dead_pid())
    barrier = threading.Barrier(8)
    winners, losers = [], []

    def start():
      lock = WorkdirLock(str(tmp_path))
      barrier.wait()
      try:
        winners.append(lock.acquire())
      except WorkdirLockedError:
        losers.append(lock)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    assert len(winners) == 1 and len(losers) == 7
    assert len(takeover_warnings(caplog)) == (existing == 'stale')
    winners[0].release()
    assert not os.listdir(tmp_path)


_STARTER = """
import sys, time
from nmt import workdir_lock
workdir, at = sys.argv[1], float(sys.argv[2])
time.sleep(max(at - time.time() - 0.05, 0))
while time.time() < at:  # All at once.
  pass
try:
  lock = workdir_lock.WorkdirLock(workdir).acquire()
except workdir_lock.WorkdirLockedError:
  print('locked', flush=True)
else:
  print('won', flush=True)
  time.sleep(2)  # Until every other starter has tried.
  lock.release()
"""


@pytest.mark.parametrize('existing', [None, 'stale'])
def test_concurrent_processes_exactly_one_wins(tmp_path, existing):
  """Trainers started at the same moment on a free or stale lock: exactly one holds it."""
  if existing == 'stale':
    write_lock(str(tmp_path), pid=dead_pid())
  at = time.time() + 1.5  # After every interpreter has started.
  starters = [subprocess.Popen([sys.executable, '-c', _STARTER, str(tmp_path), str(at)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(4)]
  outcomes = [starter.communicate(timeout=60) for starter in starters]
  results = sorted(out.strip() for out, _ in outcomes)
  assert results == ['locked'] * 3 + ['won'], outcomes
  assert sum('Taking over the stale lock' in err for _, err in outcomes) == (existing == 'stale')
  assert not os.listdir(tmp_path)


def test_train_py_refuses_a_locked_workdir_before_touching_it(tmp_path):
  """A second train.py on a held workdir exits at once with one `error:` line naming the lock,
  before config.json, the tokenizer or anything else is written (before the lock, it trained)."""
  config_json = tmp_path / 'config.json'
  config_json.write_text('{"from": "the running trainer"}')
  with WorkdirLock(str(tmp_path)):
    result = subprocess.run(
        [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', str(tmp_path),
         '--config.num_train_steps=2', '--config.eval.bleu_sentences=0'],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, 'TRANSFORMER_KEEP_MALLOC': '1'})
    assert sorted(os.listdir(tmp_path)) == ['config.json', 'train.lock']
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, result.stderr
  assert str(tmp_path / 'train.lock') in errors[0] and f'pid {os.getpid()}' in errors[0]
  assert 'Traceback' not in result.stderr
  assert config_json.read_text() == '{"from": "the running trainer"}'
