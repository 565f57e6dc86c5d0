"""Analyses of what the model and its cache did, for the window's pictures (above the cache and patches; no Qt)."""
