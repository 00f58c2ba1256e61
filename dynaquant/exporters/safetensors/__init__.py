"""Safetensors output: the compressed-tensors checkpoint writer (``writer``) that ``dynaquant.load`` reads."""
