"""Benchmarks: each figure beside a baseline measured in the same run, with the ratio."""
