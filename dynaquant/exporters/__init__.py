"""Exporters: GGUF files (via gguf-py's writer, reader and name maps) and safetensors.

GGUF side: a :class:`TensorSource` (an existing GGUF file, :func:`open_gguf_source`, or a HF
checkpoint folder, :func:`open_hf_source`) is streamed tensor by tensor through
:func:`write_gguf`. Safetensors side: :func:`write_safetensors` writes a plan's compressed-tensors
checkpoint (run by ``dynaquant.load``).
"""

from .gguf_names import HF_ARCH_TO_GGUF, gguf_to_hf_name, hf_to_gguf_name
from .gguf_source import GGUFFileSource, SourceTensor, TensorSource, open_gguf_source
from .gguf_writer import kv_value_type, write_gguf
from .hf_source import HFCheckpointSource, identify_bpe_pre_tokenizer, open_hf_source, permute_qk, unpermute_qk
from .safetensors_writer import SafetensorsResult, compressed_tensors_config, safetensors_overhead_bytes, write_safetensors

__all__ = [
    "HF_ARCH_TO_GGUF",
    "GGUFFileSource",
    "HFCheckpointSource",
    "SourceTensor",
    "TensorSource",
    "gguf_to_hf_name",
    "hf_to_gguf_name",
    "identify_bpe_pre_tokenizer",
    "kv_value_type",
    "open_gguf_source",
    "open_hf_source",
    "permute_qk",
    "unpermute_qk",
    "SafetensorsResult",
    "compressed_tensors_config",
    "safetensors_overhead_bytes",
    "write_gguf",
    "write_safetensors",
]
