"""Exporters: bytes only. ``gguf/`` writes GGUF files (gguf-py's writer; llama.cpp's layout and names) and the
vision projector's mmproj file; ``safetensors/`` writes compressed-tensors checkpoints that ``dynaquant.load`` runs.
What they write comes from a source (``dynaquant.sources``) and an encoder the pipeline hands them."""
