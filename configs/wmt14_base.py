"""The paper's base model on WMT14 English -> German (TFDS `wmt14_translate/de-en`).

  python train.py --config configs/wmt14_base.py --workdir runs/wmt14_base \
      --config.data.data_dir=/path/to/tensorflow_datasets

Table 3 "base" (512/2048/8 heads/6+6 layers, about 25k source and target tokens per step, 100k
steps, the last 5 checkpoints averaged), which the paper reports at 27.3 BLEU on newstest2014;
this project has not run it to completion (it needs accelerators).
"""

from configs import multi30k


def get_config():
  config = multi30k.get_config()
  config.num_train_steps = 100_000
  config.data.dataset_name = 'wmt14_translate/de-en'
  config.data.eval_split = 'validation'
  config.data.test_split = 'test'
  config.data.spm_sample_size = 2_000_000  # Of the 9M sentences: a bounded BPE training.
  # Ordering the pieces would tokenize all 4.5M targets first; most of a 32k vocabulary's
  # pieces occur in German targets anyway.
  config.data.target_pieces_first = False
  config.data.max_length = 128
  config.data.batch_size = 192  # 192 rows x 128 = 24,576 token slots per side.
  config.data.num_shards = 64  # 3 rows each per step; runs on 1, 2, 4, ..., 64 hosts.
  config.model.vocab_size = 32000
  config.model.d_model = 512
  config.model.num_heads = 8
  config.model.d_ff = 2048
  config.model.num_encoder_layers = 6
  config.model.num_decoder_layers = 6
  config.model.dropout_rate = 0.1
  config.model.max_len = 512
  config.model.dtype = 'bfloat16'
  config.optimizer.warmup_steps = 4000
  config.optimizer.cooldown_fraction = 0.0  # The paper's schedule to the end.
  config.optimizer.ema_decay = 0.0  # The paper averages checkpoints instead.
  config.optimizer.weight_decay = 0.0  # The paper's Adam.
  config.checkpoint_every_steps = 2000
  config.keep_checkpoints = 5
  config.average_last_checkpoints = 5
  config.decode.alpha = 0.6  # The paper's length penalty.
  config.log_every_steps = 100
  config.eval.every_steps = 2000
  config.eval.bleu_every_steps = 10_000
  config.eval.bleu_sentences = 1000
  config.decode.max_length = 512
  config.decode.batch_tokens = 16384
  return config
