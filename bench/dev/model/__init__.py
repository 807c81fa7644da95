"""A tiny real hybrid model (transformers) served through the cache: the engine adapter and the multi-request driver."""
