"""The only place that talks to the large LLM: OpenAI-compatible client (retries, cache, cost) and server launchers."""
