"""kvcache: understand, size and measure the transformer KV cache."""

__version__ = "0.1.0"

# The line every "needs torch" refusal gives: the CPU wheel first, as the README's set-up
# does, since a plain `pip install torch` on Linux pulls a multi-GB CUDA build.
TORCH_INSTALL = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
                 "pip install 'kvcache[torch]'")
