"""kvroute: a KV-cache-aware router for LLM inference fleets, with its index in Redis."""

__version__ = "0.1.0"
