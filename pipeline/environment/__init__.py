"""The only place that talks to the large LLM (the Prompt-R1 environment).

- `client.EnvironmentClient`: async OpenAI-compatible chat client with our retry/backoff policy, a
  concurrency semaphore, a persistent SQLite response cache, usage/cost accounting and a budget cap.
- `servers.environment_server(params)`: start (or reuse) llama.cpp or vLLM as params say, and stop what
  was started; `promptr1 env start|stop|status` call `servers.cli_start/cli_stop/cli_status`.

Submodules are imported explicitly (`from pipeline.environment.client import EnvironmentClient`) so that
importing the package stays cheap.
"""
