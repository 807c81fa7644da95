"""Trace replay of the prefix cache : loaders, bounds, engine model, metrics, CLI."""
