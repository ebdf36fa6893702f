"""``kvroute bench ...``: the benchmarks whose figures go into docs/benchmarks.md.

One module per benchmark (:mod:`~kvroute.bench.index`, :mod:`~kvroute.bench.agent`,
:mod:`~kvroute.bench.sim`, :mod:`~kvroute.bench.router`, :mod:`~kvroute.bench.replay` with its
workloads in :mod:`~kvroute.bench.replay_workload` and chart in :mod:`~kvroute.bench.replay_chart`),
each with ``run_from_args(args) -> int``; what they share (percentiles, waiting for a process,
stopping processes, printing results) is in :mod:`~kvroute.bench.common`.
"""
