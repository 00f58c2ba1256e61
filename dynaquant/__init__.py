"""dynaquant: dynamic low-bit quantization of LLM checkpoints."""

__version__ = "0.1.0"
