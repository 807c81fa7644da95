"""A tiny real hybrid model (transformers) served through the cache: the engine adapter and the multi-request driver."""

#: The oldest transformers the adapter runs on: the unified linear-attention cache layers
#: (``LinearAttentionLayer``) and the models' ``cache=`` keyword came in 5.24. The ``model``
#: extra asks for it; the ``test`` extra does not (an engine's own pin, e.g. SGLang 0.5.23's
#: ``transformers==5.19.0``, wins there), and the model tests skip, saying so, below it.
MIN_TRANSFORMERS = "5.24"
