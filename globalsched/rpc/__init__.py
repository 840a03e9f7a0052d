"""The scheduler's gRPC edge: the servicer, protobuf conversion, status replies and the metrics port."""
