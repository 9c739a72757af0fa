"""Tuners: choices a run makes from its own measurements (replicas per device)."""
