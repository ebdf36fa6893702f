"""A simulated vLLM engine (the KV-event publisher so far), for tests, the demo and benchmarks.

Imports nothing from ``router`` or ``worker_agent``: it stands in for the engine, which knows
nothing about kvroute."""
