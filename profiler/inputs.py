"""Synthetic, seeded input batches for a runtime's inputs (values do not affect dense-model timing)."""

from __future__ import annotations

import numpy as np

from common.tensors import TensorSpec
from profiler.errors import ProfilerError


def item_shape(spec: TensorSpec, overrides: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """The concrete per-item shape of ``spec``; variable dimensions must be given in ``overrides``."""
    if overrides and spec.name in overrides:
        shape = tuple(overrides[spec.name])
        if len(shape) != len(spec.shape) or any(
                d != s for d, s in zip(shape, spec.shape) if s >= 0):
            raise ProfilerError(f"input {spec.name!r}: shape override {list(shape)} does not match the model's "
                                f"{list(spec.shape)} (batch dimension excluded)")
        return shape
    if any(d < 0 for d in spec.shape):
        raise ProfilerError(f"input {spec.name!r} has variable dimensions {list(spec.shape)} (batch excluded); "
                            f"give concrete ones with --input-shape {spec.name}=D1xD2...")
    return tuple(spec.shape)


def make_feeds(specs: tuple[TensorSpec, ...], batch: int, seed: int,
               overrides: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """One batch of ``batch`` items for every input: standard normal floats, small non-negative ints."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = (batch, *item_shape(spec, overrides))
        dtype = spec.dtype
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 2, shape).astype(dtype)  # 0/1: safe as ids and masks
        else:
            raise ProfilerError(f"input {spec.name!r}: cannot synthesise datatype {spec.datatype}")
    return feeds


def parse_input_shapes(items: list[str] | None) -> dict[str, tuple[int, ...]]:
    """Parse ``NAME=D1xD2x...`` options (dimensions without the batch dimension)."""
    result: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
            if any(d < 1 for d in shape):
                raise ValueError
        except ValueError:
            raise ProfilerError(f"--input-shape {item!r}: expected NAME=D1xD2x... with positive dimensions") from None
        result[name] = shape
    return result
