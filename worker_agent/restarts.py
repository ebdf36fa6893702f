"""Has the engine restarted? Decided on evidence only, never on the engine being slow or away.

A new engine process starts with an empty KV cache, so its worker's entries must go; an engine
that was merely slow, overloaded or unreachable for a while still holds its cache, and clearing
the worker's entries would throw away every prefix it can serve. The evidence, from the engine's
/metrics (read every 250 ms and again when /health answers after an outage):

* ``process_start_time_seconds`` changed (vLLM's API server exports it): a new process. While
  both readings have it, it is the only evidence looked at: the same start time is the same
  process, whatever its counters do.
* Otherwise, a work counter (``vllm:prompt_tokens_total``, ``vllm:request_success_total``) went
  back: counters only grow within a process.

The event stream brings its own evidence (:mod:`worker_agent.sequencer`: seq back to 0 with
another payload). A refused connection or a /health outage alone is none: when the engine comes
back with the same start time and counters, its cache is intact (if it did restart unseen, the
first batch of the new process says so).
"""

from __future__ import annotations

from worker_agent.engine import EngineMetrics


class RestartEvidence:
    """The engine's start time and work counters as last seen; :meth:`observe` says when a new
    reading shows a new process."""

    def __init__(self) -> None:
        self.start_time: float | None = None
        self.counters: dict[str, float] = {}

    def observe(self, metrics: EngineMetrics) -> str | None:
        """Take a reading; the evidence of a restart since the last one, or None."""
        reason = None
        if metrics.start_time is not None and self.start_time is not None:
            if metrics.start_time != self.start_time:
                reason = f"process_start_time_seconds changed from {self.start_time:.3f} to {metrics.start_time:.3f}"
        else:
            reason = next(
                (
                    f"{name} went back from {self.counters[name]:g} to {value:g}"
                    for name, value in metrics.counters.items()
                    if value < self.counters.get(name, value)
                ),
                None,
            )
        if metrics.start_time is not None:
            self.start_time = metrics.start_time
        if reason is not None:
            self.counters.clear()  # the new process's counters start over
        self.counters.update(metrics.counters)
        return reason
