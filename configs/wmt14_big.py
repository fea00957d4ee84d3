"""The paper's big model on WMT14 English -> German (TFDS `wmt14_translate/de-en`).

  python train.py --config configs/wmt14_big.py --workdir runs/wmt14_big \
      --config.data.data_dir=/path/to/tensorflow_datasets

Table 3 "big" (1024/4096/16 heads, dropout 0.3, 300k steps, the last 20 checkpoints averaged),
which the paper reports at 28.4 BLEU on newstest2014; parameters and optimizer state are
sharded over an fsdp mesh axis of 2. Not run to completion by this project.
"""

from configs import wmt14_base


def get_config():
  config = wmt14_base.get_config()
  config.num_train_steps = 300_000
  config.mesh_shape = 'data:-1,fsdp:2'
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.d_ff = 4096
  config.model.dropout_rate = 0.3
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 20
  config.average_last_checkpoints = 20
  return config
