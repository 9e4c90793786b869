"""Ways in: the offline LLM API and the plait CLI."""
