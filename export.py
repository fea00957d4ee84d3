"""Turns a trained run into something that translates without this project's training stack.

  python export.py --workdir runs/multi30k --format jax --output runs/multi30k/exported \
      [--checkpoint STEP | --checkpoint averaged | --average_last N]
  python export.py --workdir runs/multi30k --format ctranslate2 --output runs/multi30k/ct2 \
      [--quantization int8]

--format jax: a `jax.export` translator (encoder + beam search, the parameters passed as
arguments, a symbolic batch dimension, one program per source-length bucket) with its
parameters and tokenizer; `serving.py`, copied into the folder, translates with it using only
jax, numpy and sentencepiece.
--format ctranslate2: a CTranslate2 model folder (`pip install -e '.[ctranslate2]'`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
from absl import app, flags, logging

import checkpoints
import console
import sharding
import translation

FLAGS = flags.FLAGS
FORMATS = ('jax', 'ctranslate2')


def export_jax(workdir: str, params: Any, output_dir: str) -> None:
  """Writes the jax.export translator of the run's model with `params` into output_dir."""
  raise NotImplementedError('--format jax is not built yet.')


def export_ctranslate2(workdir: str, params: Any, output_dir: str,
                       quantization: str | None = None) -> None:
  """Writes a CTranslate2 model folder of the run's model with `params` into output_dir."""
  raise NotImplementedError('--format ctranslate2 is not built yet.')


def export(workdir: str, output_dir: str, *, format: str = 'jax', checkpoint: str | None = None,
           average_last: int = 0, quantization: str | None = None) -> str:
  """Exports the run's parameters (newest checkpoint, a step, 'averaged' or the last N averaged)
  in `format`; returns where they came from."""
  if format not in FORMATS:
    raise ValueError(f'--format must be one of {FORMATS}, got {format!r}.')
  if quantization and format != 'ctranslate2':
    raise ValueError('--quantization applies to --format ctranslate2 only.')
  mesh = sharding.make_mesh(devices=jax.local_devices()[:1])
  params, origin = translation.load_params(workdir, mesh, checkpoint, average_last)
  params = jax.device_get(params)
  os.makedirs(output_dir, exist_ok=True)
  if format == 'jax':
    export_jax(workdir, params, output_dir)
  else:
    export_ctranslate2(workdir, params, output_dir, quantization)
  return origin


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config, tokenizer, checkpoints).')
  flags.DEFINE_string('output', None, 'Folder to write the exported model into.')
  flags.DEFINE_enum('format', 'jax', FORMATS, 'What to export to.')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', or the newest if unset.")
  flags.DEFINE_integer('average_last', 0, 'Average the newest N checkpoints.', lower_bound=0)
  flags.DEFINE_enum('quantization', None, ['int8', 'int8_float32', 'int16', 'float16'],
                    'CTranslate2 weight quantization (default: float32).')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if not FLAGS.workdir or not FLAGS.output:
    sys.exit('error: --workdir and --output are required.')
  console.quiet_libraries()
  try:
    origin = export(FLAGS.workdir, FLAGS.output, format=FLAGS.format,
                    checkpoint=FLAGS.checkpoint, average_last=FLAGS.average_last,
                    quantization=FLAGS.quantization)
  except (FileNotFoundError, ValueError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')
  logging.info('Exported %s as %s to %s.', origin, FLAGS.format, FLAGS.output)


if __name__ == '__main__':
  define_flags()
  app.run(main)
