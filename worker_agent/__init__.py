"""The worker agent (issue 2/6): turns an engine's KV events into index updates."""
