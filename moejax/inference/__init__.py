"""After pre-training: load a checkpoint for inference, evaluate it on token data, and generate text with a KV
cache through the same model code, dispatch and mesh as training."""
