"""The one reader of a Prometheus text endpoint for tests and benchmarks, over prometheus_client's
parser: a scrape is every sample keyed by its name and labels, with the families' types beside."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


def labels(**kv: str) -> Labels:
    return frozenset(kv.items())


@dataclass(frozen=True)
class Scrape:
    """``samples``: {(sample name, labels): value}; ``types``: {family name: type}; ``content_type``:
    the endpoint's Content-Type header."""
    samples: dict[tuple[str, Labels], float]
    types: dict[str, str]
    content_type: str = ""

    def value(self, name: str, default: float | None = None, **label_values: str) -> float | None:
        """The sample ``name`` with exactly these labels (``default`` when there is none)."""
        return self.samples.get((name, labels(**label_values)), default)

    def matching(self, name: str, **label_values: str) -> dict[Labels, float]:
        """Every sample ``name`` whose labels include these, by its labels."""
        want = set(label_values.items())
        return {lab: v for (n, lab), v in self.samples.items() if n == name and want <= lab}

    def total(self, name: str, **label_values: str) -> float:
        """The sum of :meth:`matching`."""
        return sum(self.matching(name, **label_values).values())


def parse(text: str, content_type: str = "") -> Scrape:
    """Parse exposition text; a sample that appears twice is an error (a broken exposition)."""
    samples: dict[tuple[str, Labels], float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            if key in samples:
                raise ValueError(f"duplicate sample {s.name} {dict(s.labels)}")
            samples[key] = s.value
    return Scrape(samples, types, content_type)


def scrape(url: str, timeout_s: float = 10.0) -> Scrape:
    """GET ``url`` and parse it; OSError when the endpoint does not answer."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse(reply.read().decode(), reply.headers.get("Content-Type", ""))
