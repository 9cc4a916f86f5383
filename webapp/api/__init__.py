"""The OpenAI-compatible HTTP API: parse and check requests, translate them, stream the answers."""
