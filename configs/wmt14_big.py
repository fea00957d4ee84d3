"""The paper's big model on WMT14 English -> German (TFDS `wmt14_translate/de-en`).

Table 3 "big": d_model 1024, d_ff 4096, 16 heads, 6+6 layers, dropout 0.3, 300k steps, the
average of the last 20 checkpoints. The paper reports 28.4 BLEU on newstest2014 after 3.5 days
on 8 P100 GPUs. Not run to completion by this project (no accelerator here). Parameters and
optimizer state are sharded over an `fsdp` mesh axis of 2 for devices with little memory.

  python train.py --config configs/wmt14_big.py --workdir runs/wmt14_big \
      --config.data_dir=/path/to/tensorflow_datasets
"""

from configs import wmt14_base


def get_config():
  config = wmt14_base.get_config()
  config.d_model = 1024
  config.num_heads = 16
  config.d_ff = 4096
  config.dropout_rate = 0.3
  config.num_train_steps = 300_000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 20
  config.average_last_checkpoints = 20
  config.mesh_shape = 'data:-1,fsdp:2'
  return config
