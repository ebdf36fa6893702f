"""The worker agent: one per engine, it turns the engine's KV-cache events into index updates.

Imports the core index (``kvindex``), never ``router``."""
