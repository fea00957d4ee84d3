"""Multi30k task 1, English -> German: a CPU-sized Transformer (the README's main job).

A post-LN Transformer (d_model 256, d_ff 1024, 4 heads, 3+3 layers, 7.6M parameters) on the
29,000 Multi30k training pairs, joint 8k sentencepiece BPE, 32 packed rows of 64 tokens per
step, the paper's Adam schedule (peak 0.002 after 1,000 warmup steps), dropout and label
smoothing 0.1. Two budgets, measured on a 2-core CPU (Intel Xeon, no GPU, jax 0.10.2) on
2026-11-22, scored on test_2016_flickr with sacreBLEU (13a, cased), beam 4, alpha 0.6:

  configs/multi30k.py        1,000 steps, 9.4 min; average of the last 3 checkpoints:
                             29.5 BLEU (29.7 lowercased), chrF 52.6. On a 2-core AMD EPYC
                             (the same evening): 13.0 min, 29.3 BLEU (29.6), chrF 51.8.
  configs/multi30k.py:full   3,250 steps, ~57 min in a run made before steps became nearly
                             twice as fast; average of the last 5 checkpoints:
                             39.5 BLEU (39.9 lowercased), chrF 63.1.

Command (offline machines point MULTI30K_DIR at the unzipped task-1 files):

  MULTI30K_DIR=../shared/data/multi30k python train.py \
      --config configs/multi30k.py --workdir runs/multi30k
  python checkpoints.py --workdir runs/multi30k      # averages the config's last N
  python decode.py --workdir runs/multi30k --split test_2016_flickr --checkpoint averaged

French instead of German: `--config.target_lang=fr`.
"""

import ml_collections


def get_config(budget: str = 'quick') -> ml_collections.ConfigDict:
  """budget: 'quick' (1,000 steps, 10-13 min on 2 CPU cores) or 'full' (3,250 steps, ~1 h)."""
  if budget not in ('quick', 'full'):
    raise ValueError(f"budget must be 'quick' or 'full', got {budget!r}.")
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
  # Packed rows per step, global (over all devices and hosts): batch_size * max_length token
  # slots per side (the paper's ~25k tokens: configs/wmt14_base.py). grad_accum_steps splits
  # them into micro-batches for devices that cannot hold a whole step.
  config.batch_size = 32
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
  config.num_train_steps = 1000
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
  config.checkpoint_every_steps = 250
  config.keep_checkpoints = 5
  config.average_last_checkpoints = 3
  config.log_every_steps = 50
  config.eval_every_steps = 250
  config.bleu_every_steps = 500
  config.num_eval_bleu_sentences = 256

  # Decoding.
  config.beam_size = 4
  config.length_penalty_alpha = 0.6
  config.max_decode_extra_length = 50  # max output length = source length + this.
  config.max_decode_length = 256
  config.eval_batch_tokens = 4096
  if budget == 'full':
    config.num_train_steps = 3250
    config.average_last_checkpoints = 5
    config.eval_every_steps = 500
    config.bleu_every_steps = 1000
  return config
