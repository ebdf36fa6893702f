"""A simulated vLLM engine for tests, the demo and benchmarks: vLLM's OpenAI API and metrics, KV
events over ZMQ (PUB and a ROUTER replay socket), vLLM v1's block pool and a timing model.

Run it with ``kvroute sim-engine`` or ``python -m sim_engine`` (:mod:`sim_engine.main`), or
in-process with :func:`sim_engine.server.running_engine`; docs/sim-engine.md describes it.

It stands in for the engine, which knows nothing about kvroute, so it imports nothing from
``worker_agent`` or ``kvindex``, and from ``router`` only :mod:`router.tokenizer`: the router and
the simulated engine tokenize prompts with one implementation. It also uses :mod:`kvservice`
(logging and start-up/shutdown, shared by every kvroute process).
"""
