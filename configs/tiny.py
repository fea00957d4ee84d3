"""A tiny model for tests and smoke runs: trains in seconds on CPU and reaches nothing useful.

20 steps of a 34k-parameter model, two evaluations and one BLEU on 16 sentences: 28 s for the
whole command on 2 CPU cores (AMD EPYC, 2026-11-22), tokenizer training and compilation
included; BLEU 0, chrF 0.25. It shows that every piece runs, not that the model learns
(`tests/test_end_to_end.py` checks that).

  MULTI30K_DIR=../shared/data/multi30k python train.py --config configs/tiny.py --workdir /tmp/tiny
"""

from configs import multi30k


def get_config():
  config = multi30k.get_config()
  config.vocab_size = 400
  config.spm_sample_size = 4000
  config.max_length = 32
  config.batch_size = 16
  config.shuffle_buffer = 1024
  config.d_model = 32
  config.num_heads = 2
  config.d_ff = 64
  config.num_encoder_layers = 1
  config.num_decoder_layers = 1
  config.model_max_len = 128
  config.num_train_steps = 20
  config.warmup_steps = 10
  config.learning_rate_scale = 2.0
  config.checkpoint_every_steps = 10
  config.keep_checkpoints = 3
  config.average_last_checkpoints = 2
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.bleu_every_steps = 20
  config.num_eval_bleu_sentences = 16
  config.max_decode_length = 64
  config.max_decode_extra_length = 10
  return config
