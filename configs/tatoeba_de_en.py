"""Tatoeba German -> English (short everyday sentences): the default recipe on a second pair.

  python train.py --config configs/tatoeba_de_en.py --workdir runs/tatoeba_de_en \
      --config.data.dataset_name=folder:../shared/data/tatoeba_deu_small
  python average.py --workdir runs/tatoeba_de_en
  python decode.py --workdir runs/tatoeba_de_en --split test --checkpoint averaged

The folder holds aligned `{train,valid,test}.{de,en}` files (on these machines
../shared/data/tatoeba_deu_small: 45k training pairs of at most 7 English words).
BENCHMARKS.md has what it reaches on the test split, with the default recipe as it was measured
there (an 8k vocabulary, FFN 1024, 2,000 steps with the rate cooled to 0 over the last
quarter, the last 3 checkpoints averaged).
"""

import ml_collections

from configs import multi30k


def get_config() -> ml_collections.ConfigDict:
  config = multi30k.get_config()
  config.data.dataset_name = 'folder:tatoeba_deu_small'  # Override with the folder's path.
  config.data.source_lang = 'de'
  config.data.target_lang = 'en'
  config.data.eval_split = 'valid'
  config.data.test_split = 'test'
  # Its measured recipe; Multi30k's default is tuned to 10k, FFN 512, 2,200 steps and a
  # moving average.
  config.model.vocab_size = 8000
  config.model.d_ff = 1024
  config.num_train_steps = 2000
  config.optimizer.cooldown_fraction = 0.25
  config.optimizer.ema_decay = 0.0
  config.average_last_checkpoints = 3
  return config
