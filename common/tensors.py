"""Tensor descriptions shared by every component: KServe v2 datatypes and their numpy twins."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# KServe v2 datatype name -> numpy dtype (BYTES is not served by this project's runtimes).
KSERVE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_KSERVE: dict[np.dtype, str] = {v: k for k, v in KSERVE_TO_NUMPY.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a KServe datatype name; KeyError names the datatype if unsupported."""
    try:
        return KSERVE_TO_NUMPY[datatype]
    except KeyError:
        raise KeyError(f"unsupported datatype {datatype!r}") from None


def kserve_datatype(dtype: np.dtype | type) -> str:
    return NUMPY_TO_KSERVE[np.dtype(dtype)]


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, KServe datatype, and shape *without* the batch dimension.

    A dimension of -1 is variable. Every served model is batched along a leading dimension that
    is not listed here (KServe metadata shows it as a leading -1).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return numpy_dtype(self.datatype)

    def item_nbytes(self) -> int | None:
        """Bytes of one batch item, or None when a dimension is variable."""
        if any(d < 0 for d in self.shape):
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_json_obj(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @staticmethod
    def from_json_obj(obj: dict) -> "TensorSpec":
        return TensorSpec(obj["name"], obj["datatype"], tuple(int(d) for d in obj["shape"]))
