"""Runtime: dynaquant's safetensors checkpoints in PyTorch. ``loader.load`` builds the model (``dynaquant.load``),
``linear.DynaLinear`` runs a quantized linear layer through ``dynaquant.kernels`` (``custom_ops``: as one node under
``torch.compile``), ``moe.DynaExperts`` a layer's
routed experts; ``decoded`` runs a GGUF file's decoded weights in the source's transformers model (evaluation)."""

from dynaquant.runtime.linear import DynaLinear
from dynaquant.runtime.loader import is_runtime_checkpoint, load
from dynaquant.runtime.moe import DynaExperts

__all__ = ["DynaExperts", "DynaLinear", "is_runtime_checkpoint", "load"]
