"""Sample multi-model queries over the sample models, registered by ``nexus serve``."""

from __future__ import annotations

import json

_IMAGE = [{"name": "image", "datatype": "FP32", "shape": [3, 64, 64]}]
_FANOUT = {"select": "detect.scores", "min": 0.5}

SAMPLE_QUERIES: dict[str, dict] = {
    # Two stages: the detector's boxes, each classified (Nexus's game / dance apps' shape).
    "detect_classify": {
        "name": "detect_classify", "slo_ms": 300, "inputs": _IMAGE,
        "stages": [
            {"name": "detect", "model": "detector", "inputs": {"input": "image"}},
            {"name": "classify", "model": "vehicle_cls", "inputs": {"input": "detect.crops"}, "fanout": _FANOUT},
        ],
        "outputs": {"scores": "detect.scores", "labels": "classify.logits"},
    },
    # Traffic: one detector feeding two classifiers (vehicles and faces), gamma about 3 each.
    "traffic": {
        "name": "traffic", "slo_ms": 400, "inputs": _IMAGE,
        "stages": [
            {"name": "detect", "model": "detector", "inputs": {"input": "image"}},
            {"name": "vehicle", "model": "vehicle_cls", "inputs": {"input": "detect.crops"}, "fanout": _FANOUT},
            {"name": "face", "model": "face_cls", "inputs": {"input": "detect.crops"}, "fanout": _FANOUT},
        ],
        "outputs": {"scores": "detect.scores", "vehicles": "vehicle.logits", "faces": "face.logits"},
    },
}


def sample_query_json(name: str) -> str:
    return json.dumps(SAMPLE_QUERIES[name], indent=2)
