"""Sources: checkpoint readers. ``checkpoint`` resolves a model argument (HF folder, hub id, GGUF file, the
embedded default) and is the one door to transformers' ``from_pretrained``; ``gguf`` and ``hf`` (with ``hf_moe``,
``hf_vl``, ``hf_vl_full`` and ``release`` for FP8 / MXFP4 release weights) list a checkpoint's tensors with their
GGUF and HF names, shapes and dtypes without reading data, and read one tensor at a time; ``open`` picks the HF
source class a folder needs, from the architecture facts of ``vl_archs``; ``experts`` knows transformers'
mixture-of-experts module layouts; ``readers`` opens GGUF, safetensors and JSON files with layout checks;
``identity`` records where a source came from; ``nonfinite`` refuses NaN / Inf weights."""
