"""A run trained on one device count decodes, averages and resumes on another.

Training on a GPU/TPU host and translating on a laptop is the common case: restores read into
the target devices' layout. Here runs are decoded on meshes of 8, 2 and 1 of this process's
devices, and by decode.py in a process that has 1 device, as a user's shell would. The fast
set's claim runs across processes: tests/test_multiprocess.py decodes a 2 x 2 run on 1 x 1 and
2 x 2 (`decode.py --distributed`) and resumes it on 1 x 4.
"""

import os
import subprocess
import sys

import cluster_launcher
import jax
import numpy as np
import pytest

import train
from configs import tiny
from nmt import checkpoints, runs, sharding
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.environ.get('MULTI30K_DIR', '')
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MULTI30K, 'train.en')),
    reason='needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these machines)')
SOURCES = ['A man rides a bike down the street.', 'Two dogs play in the snow.',
           'A woman is reading a book in a park.', 'Children are playing soccer on a field.',
           'A black cat sits on a red chair.']
CONFIG_FLAGS = ['--config.eval.every_steps=1000', '--config.eval.bleu_sentences=0',
                '--config.checkpoint_every_steps=4']


def config_for(steps: int):
  config = tiny.get_config()
  config.num_train_steps = steps
  config.checkpoint_every_steps = 4
  config.eval.every_steps, config.eval.bleu_sentences = 1000, 0
  return config


def run(script: str, *args: str, devices: int) -> str:
  """A project script in a fresh process that has `devices` CPU devices."""
  env = {**os.environ, 'XLA_FLAGS': cluster_launcher.xla_flags(devices),
         'TRANSFORMER_KEEP_MALLOC': '1'}
  result = subprocess.run([sys.executable, script, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout + result.stderr


def decode_on(workdir: str, num_devices: int, checkpoint: str | None = None) -> list[dict]:
  """The best translation of each of SOURCES on a mesh of this process's first `num_devices`
  devices, with its pieces and score: a model of a few steps may translate every source to
  pieces that read as '', so the texts alone could compare equal without saying anything."""
  config, tokenizer, model = runs.load_run(workdir)
  mesh = sharding.make_mesh('', jax.devices()[:num_devices])
  translator = translator_lib.Translator(model, tokenizer, config.decode, mesh, details=True)
  params, _ = runs.load_params(workdir, mesh, checkpoint)
  assert {d.id for d in jax.tree_util.tree_leaves(params)[0].devices()} == {
      d.id for d in mesh.devices.flat}
  return [nbest[0] for nbest in translator(params, SOURCES)]


def assert_same(got: list[dict], expected: list[dict]) -> None:
  """The same pieces and texts, the scores equal to float32 rounding."""
  assert [x['tokens'] for x in got] == [x['tokens'] for x in expected]
  assert [x['text'] for x in got] == [x['text'] for x in expected]
  np.testing.assert_allclose([x['score'] for x in got], [x['score'] for x in expected],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_trained_on_eight_devices_decodes_averages_and_resumes_on_one_and_two(tmp_path):
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(config_for(8), workdir)  # This process: 8 devices.
  expected = decode_on(workdir, 8)
  assert all(x['tokens'][-1] == '</s>' and np.isfinite(x['score']) for x in expected)
  assert_same(decode_on(workdir, 2), expected)
  assert_same(decode_on(workdir, 1), expected)
  source = tmp_path / 'src.txt'
  source.write_text(''.join(s + '\n' for s in SOURCES), encoding='utf-8')
  run('decode.py', '--workdir', workdir, '--input', str(source), '--output',
      str(tmp_path / 'hyp.txt'), devices=1)
  assert (tmp_path / 'hyp.txt').read_text(encoding='utf-8').split('\n')[:-1] == [
      x['text'] for x in expected]
  checkpoints.save_averaged(workdir, 2)
  averaged = decode_on(workdir, 8, 'averaged')
  assert_same(decode_on(workdir, 1, 'averaged'), averaged)
  log = run('train.py', '--config', 'configs/tiny.py', '--workdir', workdir, *CONFIG_FLAGS,
            '--config.num_train_steps=12', devices=2)
  assert 'Resumed from step 8' in log and 'step 12/12' in log


@pytest.mark.slow
def test_trained_on_one_device_decodes_and_resumes_on_eight(tmp_path):
  workdir = str(tmp_path / 'run')
  run('train.py', '--config', 'configs/tiny.py', '--workdir', workdir, *CONFIG_FLAGS,
      '--config.num_train_steps=8', devices=1)
  expected = decode_on(workdir, 1)
  assert_same(decode_on(workdir, 8), expected)
  assert_same(decode_on(workdir, 2), expected)
  result = train.train_and_evaluate(config_for(12), workdir)
  assert result['step'] == 12
