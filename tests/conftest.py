"""Test setup: 8 fake CPU devices (set before JAX is imported) and the local Multi30k copy."""

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
