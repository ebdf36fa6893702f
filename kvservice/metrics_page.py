"""Reading another process's Prometheus page, written once: the router's lost-token split, the dev
stack, the benchmarks and the tests read /metrics through :class:`MetricsPage`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class MetricsPage:
    """The samples of one scrape (a counter's ``_total`` and a histogram's ``_bucket`` are samples
    by those names)."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> MetricsPage:
        return cls(tuple(sample for family in text_string_to_metric_families(text) for sample in family.samples))

    def matching(self, name: str, **labels: str) -> Iterator[Sample]:
        """The samples called ``name`` whose labels include ``labels``."""
        for sample in self.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                yield sample

    def value(self, name: str, **labels: str) -> float | None:
        """The first such sample's value; None when there is none."""
        return next((float(s.value) for s in self.matching(name, **labels)), None)

    def total(self, name: str, **labels: str) -> float:
        """The sum over such samples (0 when there are none)."""
        return float(sum(s.value for s in self.matching(name, **labels)))

    def by_label(self, name: str, label: str, keep: Callable[[Sample], bool] = lambda _: True) -> dict[str, float]:
        """``{value of label: sum}`` over the samples called ``name`` (that ``keep`` keeps)."""
        out: dict[str, float] = {}
        for sample in self.matching(name):
            if label in sample.labels and keep(sample):
                out[sample.labels[label]] = out.get(sample.labels[label], 0.0) + float(sample.value)
        return out

    def flat(self) -> dict[str, float]:
        """Every sample as ``name{label=value,...}`` (labels sorted; bare name without labels)."""
        out: dict[str, float] = {}
        for sample in self.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return out


async def read_metrics(session: aiohttp.ClientSession, url: str) -> MetricsPage:
    """The page at ``url`` (a whole URL: ``http://host:port/metrics``); aiohttp's errors raised."""
    async with session.get(url) as response:
        response.raise_for_status()
        return MetricsPage.parse(await response.text())
