"""Test setup: 8 fake CPU devices in the test processes (one in the commands they start), the
local Multi30k copy, one compilation cache and one TFDS folder for the whole run (shared by
pytest-xdist's workers), fixtures built once per run, and, under CI=true, no skipped test: a
test that skips there (its data missing, say) fails instead."""

import contextlib
import os
import pathlib
import shutil
import tempfile
import uuid

# The tests' programs are tiny and each is compiled for a few calls, so XLA's compile time is
# most of the suite's: LLVM at optimization level 0, and XLA:CPU's older fusion code generator
# instead of its MLIR fusion emitters, compile them faster (BENCHMARKS.md, "CI suite").
# XLA's graph passes are the same; results may differ from the defaults' in rounding, which
# every comparison here allows for (`decode.py`, `train.py` and the benchmarks keep XLA's
# defaults). The processes the tests start inherit the flags; set before `import jax` anywhere.
TEST_XLA_FLAGS = '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'
os.environ.setdefault('XLA_FLAGS', TEST_XLA_FLAGS)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_MULTI30K = REPO.parent / 'shared' / 'data' / 'multi30k'
if SHARED_MULTI30K.is_dir():
  os.environ.setdefault('MULTI30K_DIR', str(SHARED_MULTI30K))
NEEDS_MULTI30K = ('needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these '
                  'machines)')

# One folder per test run for what the run shares: pytest-xdist's workers inherit this
# process's environment, or find the run's id in theirs.
STARTS_THE_RUN = 'NMT_TEST_RUN' not in os.environ and 'PYTEST_XDIST_WORKER' not in os.environ
RUN_ID = os.environ.setdefault('NMT_TEST_RUN', os.environ.get('PYTEST_XDIST_TESTRUNUID',
                                                              uuid.uuid4().hex))
RUN_DIR = pathlib.Path(tempfile.gettempdir()) / f'nmt-tests-{RUN_ID}'
RUN_DIR.mkdir(exist_ok=True)
# TFDS prepares datasets into the run's folder, never the user's ~/.
os.environ.setdefault('TFDS_DATA_DIR', str(RUN_DIR / 'tfds'))
# Many tests (and the processes they start) compile the same tiny programs: XLA compiles each
# once per run, into the run's folder, and later jits load it.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', str(RUN_DIR / 'jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')


import filelock  # noqa: E402  (after the environment above, which must precede any jax import)
import jax  # noqa: E402
import pytest  # noqa: E402

# Multi-device tests run on 8 fake CPU devices in the test processes. The commands the tests
# start see one, as on a CPU machine (an 8-device mesh compiles and runs more slowly there: a
# tiny train.py run took a third longer); tests that start commands on more devices say how
# many (tests/cluster_launcher.py).
jax.config.update('jax_num_cpu_devices', 8)


@contextlib.contextmanager
def one_device_meshes():
  """Within it, a mesh made without a device list (train.py's, decode's) spans the first of
  the 8 fake devices: for the tests whose claim is not about devices, as an 8-device mesh
  trains a tiny model far more slowly on CPU (the collectives of 8 devices share the cores,
  and checkpoints copy each array from 8 replicas). The multi-device claims keep their 8
  (tests/test_train.py) or start processes (tests/test_multiprocess.py)."""
  from nmt import sharding
  make_mesh = sharding.make_mesh
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, 'make_mesh', lambda mesh_shape='', devices=None: make_mesh(
        mesh_shape, jax.devices()[:1] if devices is None else devices))
    yield


@pytest.fixture
def one_device():
  with one_device_meshes():
    yield


def built_once(name: str, build) -> str:
  """RUN_DIR/name, made by `build(path)` by the first test (of any worker) that asks for it;
  the others wait for it and share it: read it, never write into it."""
  path = RUN_DIR / name
  with filelock.FileLock(str(path) + '.lock'):
    if not (path / '.complete').exists():
      shutil.rmtree(path, ignore_errors=True)
      path.mkdir()
      build(str(path))
      (path / '.complete').touch()
  return str(path)


def needs_multi30k() -> None:
  if not os.path.isfile(os.path.join(os.environ.get('MULTI30K_DIR', ''), 'train.en')):
    pytest.skip(NEEDS_MULTI30K)


# The checkpoints of `trained_run`.
TRAINED_RUN_STEPS = (100, 200, 300)


@pytest.fixture(scope='session')
def trained_run() -> str:
  """A workdir of configs/tiny.py trained 300 steps on one device to copy English sentences
  (checkpoints 100, 200 and 300), shared by every test that decodes, exports or serves a run:
  read it, never write into it. Its translations follow their sources in part, so they differ from
  sentence to sentence (a parity test between two translators is then not trivially met)."""
  needs_multi30k()

  def build(path):
    import train
    from configs import tiny
    data = os.path.join(path, 'data')  # English on both sides: a copy task.
    os.mkdir(data)
    for split in ('train', 'val', 'test_2016_flickr'):
      for lang in ('en', 'xx'):
        os.symlink(os.path.join(os.environ['MULTI30K_DIR'], f'{split}.en'),
                   os.path.join(data, f'{split}.{lang}'))
    config = tiny.get_config()
    config.data.dataset_name = f'folder:{data}'
    config.data.target_lang = 'xx'
    config.num_train_steps = TRAINED_RUN_STEPS[-1]
    config.checkpoint_every_steps = TRAINED_RUN_STEPS[0]
    config.optimizer.learning_rate_scale = 1.0
    config.optimizer.warmup_steps = 60
    config.eval.every_steps = 1000
    config.eval.bleu_sentences = 0
    config.log_every_steps = 100
    with one_device_meshes():
      train.train_and_evaluate(config, os.path.join(path, 'run'))

  return os.path.join(built_once('trained_run', build), 'run')


@pytest.fixture(scope='session')
def exported_jax(trained_run) -> str:
  """trained_run exported by `export.py --format jax` (the process a user runs), shared by the
  tests of the exported translator and of its HTTP server: read it, never write into it."""

  def build(path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, 'export.py', '--workdir', trained_run, '--format',
                             'jax', '--output', os.path.join(path, 'model')], cwd=REPO,
                            capture_output=True, timeout=900)
    assert result.returncode == 0, result.stderr.decode()[-3000:]

  return os.path.join(built_once('exported_jax', build), 'model')


def pytest_sessionfinish(session, exitstatus):
  """The run's shared folder goes once the run ends, removed by the process that made it."""
  if STARTS_THE_RUN:
    shutil.rmtree(RUN_DIR, ignore_errors=True)


def pytest_runtest_setup(item):
  """Under --dist loadgroup, pytest-xdist marks each grouped test's node id with '@group'; a
  grouped test without the mark runs beside its group's tests on another worker (two clusters
  of processes at once, module fixtures built twice): it fails, saying why."""
  if (item.config.getoption('loadgroup', False) and item.get_closest_marker('xdist_group')
      and '@' not in item.nodeid):
    pytest.fail('pytest-xdist did not group this test (--dist loadgroup): this pytest and '
                "pytest-xdist do not work together; install the versions pyproject.toml's test "
                "extra asks for (pip install -e '.[test]').", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Under CI=true a skip is a failure: CI has the shared data and every test dependency, so a
  test that skips there (data not found, a package missing) hides a claim going unchecked."""
  outcome = yield
  report = outcome.get_result()
  if report.skipped and os.environ.get('CI', '').lower() in ('1', 'true') and (
      'xfail' not in report.keywords):
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = 'failed'
    report.longrepr = f'skipped under CI=true, which must run every test: {reason}'
