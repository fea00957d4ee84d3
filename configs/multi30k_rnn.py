"""Multi30k English -> German with the attentional RNN the Transformer replaced (model/rnn.py).

  MULTI30K_DIR=../shared/data/multi30k python train.py \
      --config configs/multi30k_rnn.py --workdir runs/multi30k_rnn
  python decode.py --workdir runs/multi30k_rnn --split test_2016_flickr

A 2-layer bidirectional LSTM encoder and a 2-layer LSTM decoder with additive (Bahdanau)
attention and input feeding, on the default recipe's data, steps and optimizer; Luong's
scores with `--config.model.attention_score=general` (or `dot`).
"""

import ml_collections

from configs import multi30k


def get_config(budget: str = 'quick') -> ml_collections.ConfigDict:
  """budget: as configs/multi30k.py ('quick' or 'full')."""
  config = multi30k.get_config(budget)
  # model.make_model(config.model): every field of RNNConfig.
  config.model = ml_collections.ConfigDict()
  config.model.architecture = 'rnn'
  config.model.vocab_size = 8000
  config.model.embed_dim = 256
  config.model.hidden_dim = 512  # Each encoder direction: 256.
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.dropout_rate = 0.3
  config.model.attention_score = 'additive'  # Or Luong's 'dot', 'general'.
  config.model.input_feeding = True
  config.model.max_len = 256
  config.model.dtype = 'float32'
  config.model.param_dtype = 'float32'
  return config
