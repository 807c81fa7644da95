"""Shared test helpers: reference models, harnesses and builders used by several layers."""
