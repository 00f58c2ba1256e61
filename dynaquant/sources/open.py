"""Opening a Hugging Face checkpoint folder as a GGUF tensor source: the class its ``config.json`` asks for.

:class:`~.hf.HFCheckpointSource` reads text models, :class:`~.hf_vl.HFQwen2VLSource` (a subclass) Qwen2-VL's
language model; this module sits above both, so the data flows one way (``hf`` <- ``hf_vl`` <- ``open``).
The architecture facts are :mod:`.vl_archs`'s.
"""

from __future__ import annotations

import os

from dynaquant.sources.hf import HFCheckpointSource
from dynaquant.sources.hf_vl import open_hf_vl_source
from dynaquant.sources.hf_vl_full import refuse_gguf
from dynaquant.sources.vl_archs import is_vl_checkpoint


def open_hf_source(folder: str | os.PathLike, *, trust_remote_code: bool = False) -> HFCheckpointSource:
    """Open a HF checkpoint folder (``config.json`` + ``*.safetensors``) as a tensor source for the GGUF writer.

    Supported ``architectures``: LlamaForCausalLM, MistralForCausalLM and MixtralForCausalLM
    (GGUF ``llama``), Qwen2ForCausalLM (``qwen2``), Qwen3ForCausalLM (``qwen3``),
    Qwen2MoeForCausalLM (``qwen2moe``), Qwen3MoeForCausalLM (``qwen3moe``),
    DeepseekV3ForCausalLM (``deepseek2``, MLA), GptOssForCausalLM (``gpt-oss``); block-FP8
    weights (DeepSeek-V3's release) and MXFP4 experts (gpt-oss's release) are dequantized on
    reading (:mod:`.release`); the mixture-of-experts conversion (stacked experts, routers, MLA, gpt-oss's
    fused experts, the ``expert_*`` keys) is :mod:`.hf_moe`'s; the language model of
    Qwen2VL/Qwen2_5_VLForConditionalGeneration (``qwen2vl``, :mod:`.hf_vl`).

    ``trust_remote_code``: the user's flag, passed to transformers' config and tokenizer classes.

    Raises:
        ValueError: no config.json, an unsupported architecture (the message names the file
            and the architecture), no safetensors files, or tensors with no GGUF name.
        checkpoint.RemoteCodeError: the config or tokenizer needs the checkpoint's own code and the flag is off.
    """
    refuse_gguf(folder)  # LLaVA / Mllama: safetensors target only (the message says so)
    if is_vl_checkpoint(folder):
        return open_hf_vl_source(folder, trust_remote_code=trust_remote_code)
    return HFCheckpointSource(folder, trust_remote_code=trust_remote_code)
