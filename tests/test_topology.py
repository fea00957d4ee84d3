"""A run trained on one device count decodes, averages and resumes on another.

Training on a GPU/TPU host and translating on a laptop is the common case. Before restores read
into the target devices' layout, a run trained on 8 devices stopped decode.py on 1 device with
orbax's "Topology mismatch" error. The other device counts run in subprocesses, each with its
own number of fake CPU devices, as a user's shell would.
"""

import os
import subprocess
import sys

import pytest

import sharding
import train
import translation
from configs import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.environ.get('MULTI30K_DIR', '')
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MULTI30K, 'train.en')),
    reason='needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these machines)')
SOURCES = ['A man rides a bike down the street.', 'Two dogs play in the snow.',
           'A woman is reading a book in a park.', 'Children are playing soccer on a field.',
           'A black cat sits on a red chair.']
CONFIG_FLAGS = ['--config.eval.every_steps=1000', '--config.eval.bleu_every_steps=1000',
                '--config.checkpoint_every_steps=4']


def devices_env(count: int) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={count}'
  env['TRANSFORMER_KEEP_MALLOC'] = '1'
  return env


def run(script: str, *args: str, devices: int) -> str:
  result = subprocess.run([sys.executable, script, *args], cwd=REPO, env=devices_env(devices),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout + result.stderr


def decode_here(workdir: str, checkpoint: str | None = None) -> list[str]:
  """Translations of SOURCES with this process's 8 devices."""
  config, tokenizer, model = translation.load_run(workdir)
  translator = translation.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = translation.load_params(workdir, translator.mesh, checkpoint)
  return translator(params, SOURCES)


def decode_with(workdir: str, devices: int, tmp_path, checkpoint: str | None = None) -> list[str]:
  source = tmp_path / 'src.txt'
  source.write_text(''.join(s + '\n' for s in SOURCES), encoding='utf-8')
  output = tmp_path / f'hyp{devices}.txt'
  args = ['--workdir', workdir, '--input', str(source), '--output', str(output)]
  run('decode.py', *args, *(['--checkpoint', checkpoint] if checkpoint else []), devices=devices)
  return output.read_text(encoding='utf-8').split('\n')[:-1]


def test_trained_on_eight_devices_decodes_averages_and_resumes_on_one_and_two(tmp_path):
  workdir = str(tmp_path / 'run')
  config = tiny.get_config()
  config.num_train_steps = 8
  config.checkpoint_every_steps = 4
  config.eval.every_steps = config.eval.bleu_every_steps = 1000
  train.train_and_evaluate(config, workdir)  # This process: 8 devices, rows split 8 ways.
  expected = decode_here(workdir)
  assert any(expected)
  assert decode_with(workdir, 1, tmp_path) == expected
  assert decode_with(workdir, 2, tmp_path) == expected
  run('checkpoints.py', '--workdir', workdir, '--average_last', '2', devices=1)
  assert decode_with(workdir, 2, tmp_path, 'averaged') == decode_here(workdir, 'averaged')
  log = run('train.py', '--config', 'configs/tiny.py', '--workdir', workdir, *CONFIG_FLAGS,
            '--config.num_train_steps=12', devices=2)
  assert 'Resumed from step 8' in log and 'step 12/12' in log


def test_trained_on_one_device_decodes_and_resumes_on_eight(tmp_path):
  workdir = str(tmp_path / 'run')
  run('train.py', '--config', 'configs/tiny.py', '--workdir', workdir, *CONFIG_FLAGS,
      '--config.num_train_steps=8', devices=1)
  assert decode_here(workdir) == decode_with(workdir, 1, tmp_path)
  config = tiny.get_config()
  config.num_train_steps = 12
  config.checkpoint_every_steps = 4
  config.eval.every_steps = config.eval.bleu_every_steps = 1000
  result = train.train_and_evaluate(config, workdir)
  assert result['step'] == 12
