"""Experiments whose results docs/benchmarks/ quotes (fusion against each modality alone, contrastive recipes)."""
