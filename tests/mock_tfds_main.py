"""Runs train.py or decode.py with TFDS mocked: a dataset's real builder, random text.

  python tests/mock_tfds_main.py --dataset=wmt14_translate/de-en --splits=train,validation,test \
      --num_examples=256 train.py --config configs/wmt14_base.py --workdir /tmp/run

`tfds.testing.mock_data` patches TFDS in this process only, so every process of a job starts
here and then runs SCRIPT as `__main__` with ARGS. mock_data reads the dataset's metadata from a
folder of this process (MockPolicy.USE_FILES), written first from the builder's own
`DatasetInfo` plus the named splits: the builder then has those splits, is prepared, and is
read through the product's own checks (`nmt/data_sources.py`: `prepared_builder`, `open_split`).
Every split, and every part of `tfds.even_splits` of one, yields the same `num_examples` pairs
of mock_data's random strings (10-19 characters of ' abcdefghij' per language); the metadata
gives each split that many examples.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def write_metadata(folder: str, dataset: str, splits: list[str], num_examples: int) -> None:
  """`folder/NAME/CONFIG/VERSION/dataset_info.json` (and features.json) of `dataset`, as TFDS
  writes it after preparing: the builder's info with `splits` of `num_examples` each."""
  import tensorflow_datasets as tfds
  builder = tfds.builder(dataset, data_dir=folder)
  builder.info.set_splits(tfds.core.SplitDict(
      [tfds.core.SplitInfo(name=split, shard_lengths=[num_examples], num_bytes=0)
       for split in splits]))
  os.makedirs(builder.data_dir, exist_ok=True)
  builder.info.write_to_directory(builder.data_dir)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dataset', required=True, help='A TFDS name, e.g. wmt14_translate/de-en.')
  parser.add_argument('--splits', required=True, help='Its split names, comma-separated.')
  parser.add_argument('--num_examples', type=int, required=True, help='Pairs each split yields.')
  parser.add_argument('script', help="A script of the repository, e.g. 'train.py'.")
  parser.add_argument('args', nargs=argparse.REMAINDER, help="The script's own arguments.")
  options = parser.parse_args()
  # The script's folder on the import path, as `python SCRIPT` would have it (not tests/).
  sys.path[0] = str(REPO)
  sys.argv = [options.script, *options.args]
  import tensorflow_datasets as tfds
  with tempfile.TemporaryDirectory(prefix='tfds_metadata_') as metadata:
    write_metadata(metadata, options.dataset, options.splits.split(','), options.num_examples)
    with tfds.testing.mock_data(num_examples=options.num_examples,
                                policy=tfds.testing.MockPolicy.USE_FILES, data_dir=metadata):
      runpy.run_path(str(REPO / options.script), run_name='__main__')


if __name__ == '__main__':
  main()
