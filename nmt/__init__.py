"""The libraries behind the commands at the project's root: training (optimization, evaluation,
metrics, checkpoints, the loop's control), decoding (runs, the Translator, scoring), and what
every command shares (devices and sharding, start-up, text and tokenizer, the data sources
and the training batches behind input_pipeline.py, the workdir lock, shims for runs of older
versions). Nothing here imports a command, a config or input_pipeline.py."""
