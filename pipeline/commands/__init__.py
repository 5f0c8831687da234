"""The `promptr1` commands that are not pipeline stages: `ask` (one question through the agent), `serve` (the
registered champion over HTTP), `env` (start, check and stop the environment server) and `weights` (fetch and
verify the models the params need)."""
