"""A frontend's ModelStatistics (KServe, Triton's fields) as plain numbers, and the difference of two
snapshots: what the server says it did during a measurement."""

from __future__ import annotations

from common import grpc_util
from common.pb import kserve, kserve_grpc


def model_stats(frontend: str, model: str) -> dict:
    """ModelStatistics of one model through the KServe API, as plain numbers."""
    with grpc_util.channel(frontend) as ch:
        reply = kserve_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            kserve.ModelStatisticsRequest(name=model), timeout=10)
    s = reply.model_stats[0]
    inf = s.inference_stats
    return {
        "success_count": inf.success.count, "success_ns": inf.success.ns, "fail_count": inf.fail.count,
        "queue_count": inf.queue.count, "queue_ns": inf.queue.ns,
        # per request (Triton's count: one sample per success): the phases of the batch it ran in
        "compute_count": inf.compute_infer.count,
        "compute_ns": inf.compute_input.ns + inf.compute_infer.ns + inf.compute_output.ns,
        "execution_count": s.execution_count, "inference_count": s.inference_count,
        "batches": {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in s.batch_stats},
    }


def stats_delta(after: dict, before: dict) -> dict:
    """``after - before`` of two :func:`model_stats`; ``batches`` keeps the sizes that ran in between."""
    d = {k: after[k] - before[k] for k in after if k != "batches"}
    batches = {}
    for size, (count, ns) in after["batches"].items():
        c0, n0 = before["batches"].get(size, (0, 0))
        if count - c0 > 0:
            batches[size] = (count - c0, ns - n0)
    d["batches"] = batches
    return d
