"""Multi30k task 1, English -> German: a CPU-sized Transformer (the README's main job).

Trains a small post-LN Transformer on the 29,000 Multi30k training pairs with a
joint sentencepiece BPE vocabulary, then the README's command averages the last
checkpoints, translates `test_2016_flickr` with beam 4 and prints sacreBLEU/chrF.

Command (offline machines point MULTI30K_DIR at the unzipped task-1 files):

  MULTI30K_DIR=../shared/data/multi30k python train.py \
      --config configs/multi30k.py --workdir /tmp/multi30k

French instead of German: `--config.target_lang=fr`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Data (input_pipeline.py).
  config.dataset_name = 'multi30k'  # TFDS name, 'multi30k', or 'folder:/path/to/dir'.
  config.data_dir = ''  # TFDS data_dir ('' = TFDS default).
  config.manual_dir = ''  # Local copy of the raw files ('' = $MULTI30K_DIR).
  config.source_lang = 'en'
  config.target_lang = 'de'
  config.train_split = 'train'
  config.eval_split = 'val'
  config.test_split = 'test_2016_flickr'
  config.vocab_size = 8000  # Joint sentencepiece BPE vocabulary.
  config.spm_sample_size = 2_000_000  # Max sentences sampled to train the tokenizer.
  config.max_length = 64  # Training row length; longer pairs are dropped (and counted).
  config.batch_size = 32  # Packed rows per step, global (over all devices and hosts).
  config.shuffle_buffer = 65_536
  config.seed = 0

  # Model (model.TransformerConfig).
  config.d_model = 256
  config.num_heads = 4
  config.d_ff = 1024
  config.num_encoder_layers = 3
  config.num_decoder_layers = 3
  config.dropout_rate = 0.1
  config.attention_dropout_rate = 0.0
  config.share_embeddings = True
  config.pre_norm = False
  config.positional = 'sinusoidal'
  config.model_max_len = 256  # Longest sequence the positional table covers.
  config.dtype = 'float32'  # Compute dtype; 'bfloat16' for mixed precision.

  # Optimisation.
  config.num_train_steps = 3000
  config.warmup_steps = 1000
  config.learning_rate_scale = 1.0
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.weight_decay = 0.0
  config.grad_clip_norm = 0.0  # 0 = no clipping.
  config.label_smoothing = 0.1
  config.grad_accum_steps = 1
  config.max_consecutive_nonfinite = 10
  config.mesh_shape = ''  # e.g. 'data:4,fsdp:2'; '' = all devices on 'data'.

  # Checkpoints, evaluation, logging.
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 5
  config.average_last_checkpoints = 5
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.bleu_every_steps = 1000
  config.num_eval_bleu_sentences = 256

  # Decoding.
  config.beam_size = 4
  config.length_penalty_alpha = 0.6
  config.max_decode_extra_length = 50  # max output length = source length + this.
  config.max_decode_length = 256
  config.eval_batch_tokens = 4096
  return config
