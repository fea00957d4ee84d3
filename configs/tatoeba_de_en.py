"""Tatoeba German -> English (short everyday sentences): the default recipe on a second pair.

  python train.py --config configs/tatoeba_de_en.py --workdir runs/tatoeba_de_en \
      --config.data.dataset_name=folder:../shared/data/tatoeba_deu_small
  python decode.py --workdir runs/tatoeba_de_en --split test --checkpoint ema

The folder holds aligned `{train,valid,test}.{de,en}` files (on these machines
../shared/data/tatoeba_deu_small: 45k training pairs of at most 7 English words).
Multi30k's default recipe (d_model 256, FFN 512, 3+3 layers, a 10k joint vocabulary whose
output layer covers the English pieces, weight decay, 2,400 steps, the moving average
decoded) with the paper's length penalty (BENCHMARKS.md has its runs).
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
  # Multi30k's alpha 1.3 fits its 16-piece German targets; these English ones are short.
  config.decode.alpha = 0.6
  return config
