"""The development harness, used by tests/ and benchmarks/ and not shipped in the package: clusters of
real processes, CPU meters, baselines (ONNX Runtime direct, Triton, perf_analyzer), fault scenarios.
``nexus bench`` keeps only the load client, its report and plots (nexus/bench/)."""
