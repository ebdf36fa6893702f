"""A simulated vLLM engine for tests, the demo and benchmarks: vLLM's OpenAI API and metrics, KV
events over ZMQ (PUB and a ROUTER replay socket), vLLM v1's block pool and a timing model.

Run it with ``kvroute sim-engine`` or ``python -m sim_engine`` (:mod:`sim_engine.main`), or
in-process with :func:`sim_engine.server.running_engine`; docs/sim-engine.md describes it.

It stands in for the engine, which knows nothing about kvroute, so it imports nothing from
``router``, ``worker_agent`` or ``kvindex``: only :mod:`kvtokens` (the router and the simulated
engine tokenize prompts with one implementation) and :mod:`kvservice` (logging and
start-up/shutdown, shared by every kvroute process). tests/unit/test_imports.py holds that.
"""
