"""The engine model both bench tools drive: the cache-driving engine (core), the timed simulator over it, model presets, metrics, infinite-memory bounds and the router's side of KV events."""
