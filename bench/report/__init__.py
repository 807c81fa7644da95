"""Rendering of results: plain-text tables, the JSON form, and plots with one fixed style per policy."""
