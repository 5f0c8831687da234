"""GRPO training: local backend (CPU / one GPU) and verl backend (GPU nodes, Ray), checkpoints."""
