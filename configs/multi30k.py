"""Multi30k task 1, English -> German: a CPU-sized Transformer (the README's main job).

  MULTI30K_DIR=../shared/data/multi30k python train.py \
      --config configs/multi30k.py --workdir runs/multi30k
  python decode.py --workdir runs/multi30k --split test_2016_flickr --checkpoint ema

A post-LN Transformer (d_model 256, FFN 512, 3+3 layers, a 10k joint vocabulary whose output
layer covers the German pieces only, 6.5M parameters) with weight decay, that reaches about
39.5 BLEU on test_2016_flickr in 2,400 steps, decoded from the moving average of its parameters.
`configs/multi30k.py:full` is the published Transformer-tiny (4+4 layers of d_model 128, 2.6M
parameters) with pre-norm ScaleNorm and the same weight decay, for 10,000 steps of twice the
rows, about 40.8, decoded the same way:

  python train.py --config configs/multi30k.py:full --workdir runs/multi30k_full
  python decode.py --workdir runs/multi30k_full --split test_2016_flickr --checkpoint ema

BENCHMARKS.md has the runs. French: `--config.data.target_lang=fr`.
"""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config(budget: str = 'quick') -> ml_collections.ConfigDict:
  """budget: 'quick' (2,400 steps) or 'full' (see below)."""
  if budget not in ('quick', 'full'):
    raise ValueError(f"budget must be 'quick' or 'full', got {budget!r}.")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.num_train_steps = 2400
  # Also stop once training (the loop less validation) has taken this long; 0: no limit.
  config.max_train_minutes = 0.0
  config.mesh_shape = ''  # e.g. 'data:4,fsdp:2'; '' = every device on 'data'.

  # input_pipeline.py.
  config.data = ml_collections.ConfigDict()
  config.data.dataset_name = 'multi30k'  # TFDS name, 'multi30k', or 'folder:/path/to/dir'.
  config.data.data_dir = ''  # TFDS data_dir ('' = TFDS default).
  config.data.manual_dir = ''  # Local copy of the raw files ('' = $MULTI30K_DIR).
  config.data.source_lang = 'en'
  config.data.target_lang = 'de'
  config.data.train_split = 'train'
  config.data.eval_split = 'val'
  config.data.test_split = 'test_2016_flickr'
  config.data.spm_sample_size = 2_000_000  # Max sentences sampled to train the tokenizer.
  config.data.max_length = 64  # Training row length per side; longer pairs are dropped.
  # Packed rows per step over all devices and hosts: batch_size * max_length token slots per
  # side. optimizer.grad_accum_steps splits them into micro-batches.
  config.data.batch_size = 32
  # Fixed shards of the train split, each its own shuffled, packed pipeline; batch_size rows
  # divide over them and they divide over the hosts.
  config.data.num_shards = 4
  config.data.packing_bins = 64  # Rows each shard packs pairs into at once (best fit).
  config.data.num_workers = 0  # Grain worker processes per host (0: in the training process).
  config.data.bpe_dropout = 0.0  # Probability of skipping a BPE merge, training only.
  # Probability of replacing each piece of a training source with the unknown token (word
  # dropout), training only.
  config.data.source_token_dropout = 0.0
  # The tokenizer numbers the pieces of the training targets first, and train.py sets
  # model.output_vocab_size to cover just them: no logits for pieces no target holds.
  config.data.target_pieces_first = True

  # model.make_model(config.model): every field of TransformerConfig (architecture
  # 'transformer', the default; configs/multi30k_rnn.py: the RNN's).
  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 10000  # Joint sentencepiece BPE, trained to this size.
  # Ids the output layer scores (0: all); train.py sets it with data.target_pieces_first
  # (another value than the one it computes is an error).
  config.model.output_vocab_size = 0
  config.model.d_model = 256
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.0
  config.model.layer_drop_rate = 0.0  # LayerDrop: skip each layer with this probability.
  config.model.max_len = 256  # Longest sequence the positional table covers.
  config.model.share_embeddings = True
  config.model.pre_norm = False
  config.model.norm = 'layer'  # Or 'scale' (ScaleNorm), with pre_norm.
  config.model.fix_norm = False  # True: unit-length embedding rows (FixNorm).
  config.model.positional = 'sinusoidal'
  config.model.activation = 'relu'
  config.model.attention_probs = 'softmax'  # Or 'sparsemax', 'entmax15'.
  config.model.attention_score = 'scaled_dot'  # Or 'dot', 'bilinear', 'additive'.
  config.model.linear_attention = False  # True: linear attention (model/linear_attention.py).
  config.model.layer_norm_epsilon = 1e-6
  config.model.dtype = 'float32'  # Compute dtype; 'bfloat16' for mixed precision.
  config.model.param_dtype = 'float32'
  config.model.cpu_tuned = placeholder(bool)  # None: the CPU-tuned kernels on CPU only.
  config.model.attention_implementation = placeholder(str)  # jax.nn.dot_product_attention's.

  # The paper's Adam and learning-rate schedule, and what happens to each update.
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.warmup_steps = 700
  config.optimizer.learning_rate_scale = 1.0
  # > 0: the run's last fraction scales the paper's rate down linearly to 0, whatever
  # num_train_steps is; 0: the paper's decay to the end (the moving average below anneals).
  config.optimizer.cooldown_fraction = 0.0
  config.optimizer.adam_b1 = 0.9
  config.optimizer.adam_b2 = 0.98
  config.optimizer.adam_eps = 1e-9
  # AdamW's decoupled decay of the matrices (embeddings included), scaled by the learning rate;
  # the paper has none. On 29k pairs it raises `val` BLEU at every seed tried (BENCHMARKS.md).
  config.optimizer.weight_decay = 0.1
  config.optimizer.grad_clip_norm = 0.0  # 0 = no clipping.
  config.optimizer.label_smoothing = 0.1
  # R-Drop (nmt/optimization.py): > 0 adds this weight times the two dropout passes' KL;
  # every step then runs the model twice.
  config.optimizer.rdrop_alpha = 0.0
  config.optimizer.grad_accum_steps = 1
  config.optimizer.max_consecutive_nonfinite = 10
  # Exponential moving average of the parameters (0 = none), e.g. 0.999: checkpointed with
  # them, evaluated instead of them, decoded with `decode.py --checkpoint ema`.
  config.optimizer.ema_decay = 0.999

  # Checkpoints and logging.
  config.checkpoint_every_steps = 250
  config.keep_checkpoints = 5
  # What average.py averages by default; the recipes decode their moving average instead.
  config.average_last_checkpoints = 1
  config.log_every_steps = 50

  # Validation during training.
  config.eval = ml_collections.ConfigDict()
  config.eval.every_steps = 250  # Loss, perplexity and accuracy on data.eval_split.
  config.eval.bleu_every_steps = 500
  config.eval.bleu_sentences = 256  # The first N of data.eval_split; 0: no BLEU.
  # '' or 'bleu', 'chrf' (at each BLEU evaluation), 'loss' (validation NLL, at each
  # evaluation): the best parameters by it go to WORKDIR/best/ (`decode.py --checkpoint best`).
  config.eval.keep_best_metric = ''
  # Stop after this many evaluations of keep_best_metric without improvement (0 = never).
  config.eval.early_stopping_patience = 0

  # Beam search (decode.py and BLEU during training).
  config.decode = ml_collections.ConfigDict()
  config.decode.beam_size = 4
  # Length-penalty exponent: 1.3 divides a score by about its length near this data's mean
  # target of 16 pieces (fairseq's normalisation, as the published Multi30k results decode);
  # the paper's 0.6 favours shorter output.
  config.decode.alpha = 1.3
  config.decode.max_extra_length = 50  # Output length <= source length + this.
  # 'early': a sentence ends once no live hypothesis would beat its finished ones by ending at
  # the next step (CTranslate2's rule, far fewer steps); 'exact': not even at its length limit.
  config.decode.stopping = 'early'
  # The fewest tokens before the end of a translation: 1, never an empty one (fairseq's and
  # CTranslate2's default); an empty source still gets an empty translation.
  config.decode.min_length = 1
  config.decode.max_length = 256  # And <= this.
  config.decode.batch_tokens = 4096  # Source tokens per batch.

  if budget == 'full':
    # The published Transformer-tiny of this data (Wu et al. 2021): 4+4 layers of d_model 128,
    # FFN 256, dropout 0.3 and a 10k joint vocabulary, trained on twice the quick recipe's rows
    # a step (half the published batch: twice the updates in the same time) at the published
    # peak rate of about 0.005 after 2,000 warm-up steps, the paper's decay to the end.
    config.num_train_steps = 10000
    config.data.batch_size = 64
    config.data.target_pieces_first = False  # The recipe as measured (BENCHMARKS.md, B64).
    config.model.d_model = 128
    config.model.d_ff = 256
    config.model.num_encoder_layers = 4
    config.model.num_decoder_layers = 4
    config.model.dropout_rate = 0.3
    # Pre-LN with ScaleNorm (Nguyen & Salazar 2019) in place of the published post-LN: over
    # these steps it reaches a lower validation loss and a higher `val` BLEU (BENCHMARKS.md).
    config.model.pre_norm = True
    config.model.norm = 'scale'
    config.optimizer.warmup_steps = 2000
    config.optimizer.learning_rate_scale = 2.5
    # The default's weight decay (0.1) is kept: it raises `val` BLEU here too (BENCHMARKS.md).
    config.average_last_checkpoints = 5
    config.eval.every_steps = 500
    config.eval.bleu_every_steps = 1000
  return config
