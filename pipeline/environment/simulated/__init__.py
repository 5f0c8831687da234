"""The knowledgeable stand-in environment (tests and the learn profiles): a server that knows the gold answers, in the
question, terse and hops modes; the real environment is the LLM behind pipeline/environment/client.py."""
