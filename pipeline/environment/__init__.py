"""The only place that talks to the large LLM (the Prompt-R1 environment).

- `client.EnvironmentClient`: async OpenAI-compatible chat client with our retry/backoff policy, a
  concurrency semaphore, a persistent SQLite response cache, usage/cost accounting and a budget cap.
- `ledger.CostLedger`: the budget, shared by every process of a project through a locked file;
  `sanitize`: environment text made safe to record in MLflow; `tracing`: the MLflow spans of requests.
- `servers.serve_environment(spec)` (a `spec.ServerSpec`, built by the stage from its params): start (or
  reuse) llama.cpp or vLLM as the spec says, and stop what was started; `promptr1 env start|stop|status`
  (pipeline/commands/env.py) start and stop servers that outlive one command.

Submodules are imported explicitly (`from pipeline.environment.client import EnvironmentClient`) so that
importing the package stays cheap.
"""
