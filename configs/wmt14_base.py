"""The paper's base model on WMT14 English -> German (TFDS `wmt14_translate/de-en`).

Table 3 "base": d_model 512, d_ff 2048, 8 heads, 6+6 layers, dropout 0.1, label smoothing 0.1,
a shared ~37k BPE vocabulary (we use a 32k joint sentencepiece BPE), about 25,000 source and
25,000 target tokens per step (here 192 packed rows of 128 tokens = 24,576 per side), 100k
steps with 4,000 warmup steps, and the average of the last 5 checkpoints.

The paper reports 27.3 BLEU on newstest2014 after 12 hours on 8 P100 GPUs. This config has not
been run to completion by this project (no accelerator here); expect a similar budget on
8 modern GPUs or a TPU v3-8.

  python train.py --config configs/wmt14_base.py --workdir runs/wmt14_base \
      --config.data_dir=/path/to/tensorflow_datasets
"""

from configs import multi30k


def get_config():
  config = multi30k.get_config()
  config.dataset_name = 'wmt14_translate/de-en'
  config.source_lang = 'en'
  config.target_lang = 'de'
  config.train_split = 'train'
  config.eval_split = 'validation'
  config.test_split = 'test'
  config.vocab_size = 32000
  config.spm_sample_size = 10_000_000
  config.max_length = 128
  config.batch_size = 192
  config.shuffle_buffer = 1_000_000

  config.d_model = 512
  config.num_heads = 8
  config.d_ff = 2048
  config.num_encoder_layers = 6
  config.num_decoder_layers = 6
  config.dropout_rate = 0.1
  config.model_max_len = 512
  config.dtype = 'bfloat16'

  config.num_train_steps = 100_000
  config.warmup_steps = 4000
  config.checkpoint_every_steps = 2000
  config.keep_checkpoints = 5
  config.average_last_checkpoints = 5
  config.log_every_steps = 100
  config.eval_every_steps = 2000
  config.bleu_every_steps = 10_000
  config.num_eval_bleu_sentences = 1000
  config.max_decode_length = 512
  config.eval_batch_tokens = 16384
  return config
