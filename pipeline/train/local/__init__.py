"""The local training backend: GRPO in this process with transformers (CPU or one GPU); imports nothing of
pipeline/train/verl/."""
