"""kvcache: understand, size and measure the transformer KV cache."""

__version__ = "0.1.0"
