"""The stateless router: OpenAI-compatible replicas that share one index and one view of load.

Imports the core index (``kvindex``), never ``worker_agent``."""
