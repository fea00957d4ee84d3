"""Throughput of the Multi30k training input pipeline (configs/multi30k.py).

  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.input_pipeline \
      [--workdir DIR] [--json out.json] [--batches 500]

Reports setup time (read + tokenize + pack the first epoch), batches/s and tokens/s
(non-padding target tokens, non-padding source+target tokens, and all slots) after a
warm-up, the time to pack one epoch, and the packing efficiency. The default 500
batches cross at least one epoch boundary (~230 batches per epoch at batch 32).
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import input_pipeline as ip
from configs import multi30k


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='', help='Keeps tokenizer.model and TFDS data.')
  parser.add_argument('--json', default='', help='Write the results here as JSON.')
  parser.add_argument('--batches', type=int, default=500)
  parser.add_argument('--warmup', type=int, default=20)
  args = parser.parse_args(argv)

  if not os.environ.get(ip.MULTI30K_ENV):
    local = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'
    if local.is_dir():  # The checkout's sibling data folder, if any; else TFDS downloads.
      os.environ[ip.MULTI30K_ENV] = str(local)
  workdir = args.workdir or tempfile.mkdtemp(prefix='bench_input_')
  config = multi30k.get_config()
  config.data.data_dir = config.data.data_dir or os.path.join(workdir, 'tfds')

  t0 = time.perf_counter()
  tokenizer = ip.load_or_train_tokenizer(config, workdir)
  t_tok = time.perf_counter() - t0
  t0 = time.perf_counter()
  it = ip.make_train_iterator(config, tokenizer)
  t_setup = time.perf_counter() - t0
  t0 = time.perf_counter()
  for stream in it.streams:  # Cost of one epoch's packing (normally hidden in a thread).
    stream.pack_epoch(1)
  t_pack = time.perf_counter() - t0

  for _ in range(args.warmup):
    next(it)
  tgt_tokens = src_tokens = slots = 0
  t0 = time.perf_counter()
  for _ in range(args.batches):
    batch = next(it)
    tgt_tokens += int((batch['targets_segmentation'] > 0).sum())
    src_tokens += int((batch['inputs_segmentation'] > 0).sum())
    slots += batch['inputs'].size + batch['targets'].size
  elapsed = time.perf_counter() - t0
  it.close()

  results = {
      'batch_size': config.data.batch_size, 'max_length': config.data.max_length,
      'vocab_size': tokenizer.vocab_size, 'batches': args.batches,
      'tokenizer_seconds': round(t_tok, 3), 'setup_seconds': round(t_setup, 3),
      'pack_epoch_seconds': round(t_pack, 3), 'batches_per_epoch': min(it.epoch_batches),
      'batches_per_second': round(args.batches / elapsed, 1),
      'target_tokens_per_second': round(tgt_tokens / elapsed),
      'real_tokens_per_second': round((tgt_tokens + src_tokens) / elapsed),
      'total_slots_per_second': round(slots / elapsed),
      'packing_efficiency': round(float(np.mean(it.packing_efficiency)), 4),
      'measured_nonpad_share': round((tgt_tokens + src_tokens) / slots, 4),
      'final_state': it.get_state(),
  }
  for k, v in results.items():
    print(f'{k:>28}: {v}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == '__main__':
  main()
