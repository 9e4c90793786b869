"""Benchmarks: the serving load generator, the step timeline, and the W4 / W5 workloads."""
