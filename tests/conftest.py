"""Test setup: 8 fake CPU devices (set before JAX is imported), the local Multi30k copy, and
one compilation cache for the session."""

import os
import pathlib
import tempfile

# Multi-device tests run on fake CPU devices; this must happen before `import jax` anywhere.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
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
