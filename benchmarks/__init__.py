"""Benchmarks: each runs our path and its baseline in one run and prints both and their ratio."""
