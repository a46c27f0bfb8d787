"""Experiments whose results BENCHMARKS.md quotes (fusion against each modality alone)."""
