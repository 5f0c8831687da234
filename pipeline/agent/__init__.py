"""The Prompt-R1 agent protocol (template, tags, parsing, token masks), policy backends and the multi-turn rollout. Knows nothing of training."""
