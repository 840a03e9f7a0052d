"""Actuators: what carries a plan out. Tables to backends and frontends (make before break), device
counts, and profiling runs on backends."""
