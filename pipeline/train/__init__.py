"""GRPO training. This package holds what both backends share (the plan, checkpoints, completion, the health gate,
the MLflow record, merging); the backends are local/ (this process) and verl/ (GPU nodes, Ray)."""
