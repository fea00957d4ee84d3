"""A tiny model for tests and smoke runs: it shows that every piece runs, not that it learns.

  MULTI30K_DIR=../shared/data/multi30k python train.py --config configs/tiny.py --workdir /tmp/tiny

20 steps of a 34k-parameter model, two evaluations and one BLEU on 16 sentences, in well under a
minute on 2 CPU cores; `tests/test_end_to_end.py` checks that the real recipe learns.
"""

from configs import multi30k


def get_config():
  config = multi30k.get_config()
  config.num_train_steps = 20
  config.data.spm_sample_size = 4000
  config.data.max_length = 32
  config.data.batch_size = 16
  config.data.packing_bins = 16
  config.model.vocab_size = 400
  config.model.d_model = 32
  config.model.num_heads = 2
  config.model.d_ff = 64
  config.model.num_encoder_layers = 1
  config.model.num_decoder_layers = 1
  config.model.max_len = 128
  config.optimizer.warmup_steps = 10
  config.optimizer.cooldown_fraction = 0.0
  config.optimizer.ema_decay = 0.0
  config.optimizer.learning_rate_scale = 2.0
  config.checkpoint_every_steps = 10
  config.keep_checkpoints = 3
  config.average_last_checkpoints = 2
  config.log_every_steps = 5
  config.eval.every_steps = 10
  config.eval.bleu_every_steps = 20
  config.eval.bleu_sentences = 16
  config.decode.max_length = 64
  config.decode.max_extra_length = 10
  return config
