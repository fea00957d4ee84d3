"""Test setup: 8 fake CPU devices (set before JAX is imported), the local Multi30k copy, and
one compilation cache for the session."""

import os
import pathlib
import tempfile

# Multi-device tests run on fake CPU devices; this must happen before `import jax` anywhere.
# The tests' programs are tiny and each is compiled for a few calls, so XLA's compile time is
# most of the suite's: LLVM at optimization level 0 compiles them faster (BENCHMARKS.md).
# XLA's graph passes are the same; results may differ from the default level's in rounding,
# which every comparison here allows for (`decode.py`, `train.py` and the benchmarks keep
# XLA's default level). The processes the tests start inherit the flags.
TEST_XLA_FLAGS = '--xla_backend_optimization_level=0'
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_MULTI30K = REPO.parent / 'shared' / 'data' / 'multi30k'
if SHARED_MULTI30K.is_dir():
  os.environ.setdefault('MULTI30K_DIR', str(SHARED_MULTI30K))

# TFDS prepares datasets into a fresh folder per test session, never the user's ~/.
os.environ.setdefault('TFDS_DATA_DIR', tempfile.mkdtemp(prefix='tfds_'))

# Many tests (and the processes they start) compile the same tiny programs: XLA compiles each
# once per test session, into a fresh folder, and later jits load it.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', tempfile.mkdtemp(prefix='jax_cache_'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')


import pytest  # noqa: E402  (after the environment above, which must precede any jax import)


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory) -> str:
  """A workdir of configs/tiny.py trained 12 steps (checkpoints 4, 8, 12), shared by every
  test of the session that decodes or exports a run: read it, never write into it."""
  multi30k = os.environ.get('MULTI30K_DIR', '')
  if not os.path.isfile(os.path.join(multi30k, 'train.en')):
    pytest.skip('needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these '
                'machines)')
  import train
  from configs import tiny
  path = tmp_path_factory.mktemp('tiny_run')
  config = tiny.get_config()
  config.num_train_steps = 12
  config.checkpoint_every_steps = 4
  config.eval.every_steps = 1000
  config.eval.bleu_sentences = 0
  train.train_and_evaluate(config, str(path))
  return str(path)
