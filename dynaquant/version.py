"""The package version (PEP 440), recorded in every output (GGUF ``dynaquant.version``, safetensors config)."""

__version__ = "0.1.0"
