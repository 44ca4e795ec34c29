"""The episode: the agent loop, its LLM calls and inference clients, tokens, tool calls, harnesses."""
