"""Trace replay of the prefix cache (SPEC section 7): loaders, bounds, engine model, metrics, CLI."""
