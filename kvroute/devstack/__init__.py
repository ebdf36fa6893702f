"""A kvroute deployment on one machine, for the demo, the benchmarks and the tests.

* :mod:`~kvroute.devstack.embedded_redis`: a private Redis/Valkey server on a free port;
* :mod:`~kvroute.devstack.stack`: simulated engines, an agent each and router replicas, as processes;
* :mod:`~kvroute.devstack.peers`: peer routers for comparisons (SGLang's);
* :mod:`~kvroute.devstack.passthrough`: a bare aiohttp pass-through, the floor of a Python hop
  (``python -m kvroute.devstack.passthrough PORT UPSTREAM_URL``).
"""
