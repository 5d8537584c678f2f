"""Benchmarks (run as modules: `python -m benchmarks.sim_speed`)."""
