"""CPU-tuned twins of the Transformer's primitives and decoding loop, chosen by
`TransformerConfig.use_cpu_tuned` (on when JAX runs on the CPU; GPU and TPU runs never take
them): the same parameters and, up to rounding, the same results (tests hold them equal)."""
