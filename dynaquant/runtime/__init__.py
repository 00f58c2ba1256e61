"""Runtime: dynaquant's safetensors checkpoints in PyTorch. ``loader.load`` builds the model (``dynaquant.load``),
``loader.DynaLinear`` runs a quantized linear layer through ``dynaquant.kernels``, ``moe.DynaExperts`` a layer's
routed experts; ``decoded`` runs a GGUF file's decoded weights in the source's transformers model (evaluation)."""

from dynaquant.runtime.loader import DynaLinear, is_runtime_checkpoint, load
from dynaquant.runtime.moe import DynaExperts

__all__ = ["DynaExperts", "DynaLinear", "is_runtime_checkpoint", "load"]
