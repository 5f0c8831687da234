"""The verl training backend: GRPO on a Ray cluster of GPU nodes, launched and watched from here; imports nothing of
pipeline/train/local/."""
