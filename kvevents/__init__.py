"""Engines' KV-event wire formats, one typed schema per engine, shared by the agent (which decodes
them) and the simulated engine (which encodes them). Imports nothing from the project."""
