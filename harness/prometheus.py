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


def buckets(scrape_: Scrape, name: str, **label_values: str) -> dict[float, float]:
    """Histogram ``name``'s cumulative counts by bucket bound (``+Inf`` as inf), summed over every
    series whose labels include these."""
    out: dict[float, float] = {}
    for lab, value in scrape_.matching(f"{name}_bucket", **label_values).items():
        bound = float(dict(lab)["le"])
        out[bound] = out.get(bound, 0.0) + value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, int]:
    """Of the observations between two readings of :func:`buckets`: the bound of the bucket that their
    ``q``-quantile falls in (inf: beyond the largest finite bound; 0.0 with none) and their count."""
    bounds = sorted(after)
    delta = [after[b] - before.get(b, 0.0) for b in bounds]
    total = delta[-1] if delta else 0.0
    if total <= 0:
        return 0.0, 0
    return next(b for b, cumulative in zip(bounds, delta) if cumulative >= q * total), int(total)
