"""Averages a run's newest checkpoints into WORKDIR/averaged/ (`decode.py --checkpoint averaged`).

  python average.py --workdir runs/multi30k [--average_last N]

N defaults to the run config's `average_last_checkpoints`. Damaged checkpoints are skipped for
the next older ones with a warning (nmt/checkpoints.py).
"""

import json
import os
import sys

from absl import app, flags

from nmt import checkpoints, console

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  console.quiet_libraries()
  count = FLAGS.average_last
  try:
    if count is None:  # The run's own choice, from its config.
      path = os.path.join(FLAGS.workdir, 'config.json')
      if not os.path.isfile(path):
        raise FileNotFoundError(f'{path} not found: --workdir must be a training workdir.')
      with open(path, encoding='utf-8') as f:
        count = json.load(f).get('average_last_checkpoints')
      if count is None:
        raise ValueError(f'{path} has no average_last_checkpoints; pass --average_last N.')
    checkpoints.save_averaged(FLAGS.workdir, count)
  except (FileNotFoundError, ValueError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Training workdir.', required=True)
  flags.DEFINE_integer('average_last', None, 'Number of newest checkpoints to average '
                       "(default: the run config's average_last_checkpoints).", lower_bound=1)
  app.run(main)
