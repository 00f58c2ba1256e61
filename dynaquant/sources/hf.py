"""A Hugging Face checkpoint folder as a tensor source for the GGUF writer.

Spec: llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/base.py`` ``TextModel``,
``conversion/llama.py`` ``LlamaModel``, ``conversion/qwen.py`` ``Qwen2Model``/``Qwen3Model``),
re-implemented for the Llama family and the MoE architectures of :mod:`.hf_moe`:

- tensors: ``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``),
  streamed one tensor at a time with ``safetensors.safe_open``; names mapped with gguf-py's
  ``TensorNameMap``; for the ``llama`` architecture q_proj/k_proj rows are permuted from HF's
  rotate-half layout to llama.cpp's interleaved one (``LlamaModel.permute``); Qwen2/Qwen3
  use NEOX RoPE in llama.cpp and are not permuted; ``lm_head`` is dropped when
  ``tie_word_embeddings`` (llama.cpp then reuses ``token_embd``); a ``rope_freqs.weight``
  tensor is generated for ``rope_type: llama3`` (Llama 3.1+).
- metadata: the architecture hyper-parameters, general.* from gguf-py's ``Metadata``, and the
  tokenizer written with gguf-py's vocab helpers (``BpeVocab``/``LlamaHfVocab``/
  ``SpecialVocab``), the BPE pre-tokenizer identified as llama.cpp does (see
  :func:`identify_bpe_pre_tokenizer`).
"""

from __future__ import annotations

import logging
import math
import os
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGUFWriter, TokenType

from dynaquant.names import HF_ARCH_TO_GGUF, TensorName, hf_to_gguf_name
from dynaquant.sources import hf_moe
from dynaquant.sources import release as hf_dequant
from dynaquant.sources.checkpoint import RemoteCodeError, from_pretrained
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.readers import SafetensorsReader, open_safetensors, read_json_object

logger = logging.getLogger(__name__)

# The text llama.cpp encodes to identify a BPE pre-tokenizer (convert_hf_to_gguf_update.py's
# ``CHK_TXT``); the hash is sha256 of ``str(tokenizer.encode(text))`` with the tokenizer's
# default special tokens. Must stay byte-identical to llama.cpp's.
PRE_TOKENIZER_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256 of the check text's token ids -> ``tokenizer.ggml.pre`` (llama.cpp's
# ``get_vocab_base_pre`` table, for the families our architectures use).
KNOWN_PRE_TOKENIZER_HASHES: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3.x
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/SmolLM2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2/2.5/3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3 (later tokenizers)
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # llama arch
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
}

# HF checkpoint tensors with no GGUF counterpart, left out of every HF source (recomputed by the model)
SKIPPED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def _looks_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special`` heuristic for added tokens marked not special."""
    return (
        token in ("<pad>", "<mask>")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
    )


def identify_bpe_pre_tokenizer(tokenizer) -> str:
    """The ``tokenizer.ggml.pre`` value of a BPE tokenizer, identified as llama.cpp does.

    Args:
        tokenizer: a transformers tokenizer (``encode(text) -> list[int]``).
    Returns:
        The name from :data:`KNOWN_PRE_TOKENIZER_HASHES`, or ``"default"`` (with a logged
        warning) when the hash is unknown; llama.cpp then uses its generic GPT-2 style split.
    """
    ids = list(tokenizer.encode(PRE_TOKENIZER_CHECK_TEXT))
    digest = sha256(str(ids).encode()).hexdigest()
    name = KNOWN_PRE_TOKENIZER_HASHES.get(digest)
    if name is None:
        logger.warning(
            "unknown BPE pre-tokenizer (hash %s); writing tokenizer.ggml.pre='default', which may tokenize "
            "differently from the original tokenizer", digest
        )
        return "default"
    logger.info("BPE pre-tokenizer: %s", name)
    return name


# safetensors dtypes whose per-expert tensors are kept as stored when a MoE block's experts are packed
_PACKED_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


class HFCheckpointSource(TensorSource):
    """A HF checkpoint folder as a tensor source (see :func:`.open.open_hf_source`)."""

    # set by _index_tensors; these class defaults serve subclasses that index their own tensors (hf_vl)
    _composites: dict = {}  # GGUF name -> hf_moe composite (stacked experts, MLA splits)
    _fp8_scale: dict = {}  # FP8 weight name -> its scale tensor's name
    _fp8_block = None
    _dtypes: dict = {}  # HF name -> safetensors dtype
    trust_remote_code = False  # the user's --trust-remote-code, for transformers' config and tokenizer classes

    def __init__(self, folder: str | os.PathLike, *, trust_remote_code: bool = False):
        self.folder = Path(folder)
        self.trust_remote_code = trust_remote_code
        self.source_id = str(self.folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{config_path}: no config.json in the checkpoint folder {self.folder}")
        self.config = read_json_object(config_path)
        archs = self.config.get("architectures") or []
        self.hf_arch = archs[0] if archs else None
        if self.hf_arch not in HF_ARCH_TO_GGUF:
            raise ValueError(
                f"{config_path}: unsupported architecture {self.hf_arch!r} in {self.folder}; "
                f"supported: {', '.join(HF_ARCH_TO_GGUF)}"
            )
        self.arch = HF_ARCH_TO_GGUF[self.hf_arch]
        self.hparams = self._load_hparams()
        self.n_layers = int(self.hparams["num_hidden_layers"])
        self.n_head = int(self.hparams["num_attention_heads"])
        self.n_head_kv = int(self.hparams.get("num_key_value_heads") or self.n_head)
        if self.arch == "deepseek2":
            self.n_head_kv = 1  # MLA runs as MQA in llama.cpp (deepseek2.attention.head_count_kv = 1)
        self.n_expert = int(hf_moe.expert_count(self.hparams))
        self.tied = bool(self.hparams.get("tie_word_embeddings", False))
        self.rope = dict(self.hparams.get("rope_parameters") or self.hparams.get("rope_scaling") or {})
        self._files = self._tensor_files()
        self._reader = SafetensorsReader()  # (a shard's header parsed once per 512 MiB read, not per tensor)
        self._tensors, self._hf_of = self._index_tensors()
        logger.info("%s: %s -> GGUF %s, %d blocks, %d tensors", self.folder, self.hf_arch, self.arch,
                    self.n_layers, len(self._tensors))

    # -- config and tensor index ---------------------------------------------------------

    def _load_hparams(self) -> dict[str, Any]:
        # As the converter: transformers' config class fills defaults and normalises legacy
        # keys (rope_theta/rope_scaling -> rope_parameters); the raw JSON is the fallback.
        try:
            from transformers import AutoConfig

            hp = from_pretrained(AutoConfig, self.folder, trust_remote_code=self.trust_remote_code).to_dict()
        except RemoteCodeError:
            raise  # the checkpoint's own code is needed: never fall back silently
        except Exception as e:  # noqa: BLE001 - any failure falls back to the raw file
            logger.warning("%s: transformers could not load the config (%s); using config.json as is", self.folder, e)
            hp = dict(self.config)
        for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
            if key not in hp:
                raise ValueError(f"{self.folder / 'config.json'}: missing {key!r}")
        return hp

    def _tensor_files(self) -> dict[str, Path]:
        """HF tensor name -> the safetensors file holding it."""
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map") or {}
            files = {name: self.folder / fn for name, fn in weight_map.items()}
            missing = sorted({str(p) for p in files.values() if not p.is_file()})
            if missing:
                raise ValueError(f"{index}: shard files missing: {', '.join(missing)}")
            return files
        paths = [self.folder / "model.safetensors"] if (self.folder / "model.safetensors").is_file() else []
        paths = paths or sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise ValueError(f"{self.folder}: no *.safetensors files (only safetensors checkpoints are supported)")
        files: dict[str, Path] = {}
        for p in paths:
            with open_safetensors(p) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                    files[name] = p
        return files

    def _index_tensors(self) -> tuple[list[SourceTensor], dict[str, str]]:
        shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}  # HF name -> safetensors dtype ("BF16", "F8_E4M3", ...)
        by_file: dict[Path, list[str]] = {}
        for name, p in self._files.items():
            by_file.setdefault(p, []).append(name)
        for p, names in by_file.items():
            with open_safetensors(p) as f:
                for name in names:
                    sl = f.get_slice(name)
                    shapes[name] = tuple(int(n) for n in sl.get_shape())
                    self._dtypes[name] = sl.get_dtype()

        shapes = self._fold_quantization_tensors(shapes)
        tensors: list[tuple[tuple, SourceTensor]] = []
        hf_of: dict[str, str] = {}
        unmapped = []
        composites = hf_moe.composite_tensors(self.arch, shapes, self.hparams, self.n_layers, str(self.folder))
        self._composites = {c.tensor.gguf_name: c for c in composites}
        used = {name for c in composites for name in c.consumes}
        for c in composites:
            tensors.append((self._order_key(c.tensor.gguf_name), c.tensor))
            hf_of[c.tensor.gguf_name] = c.tensor.hf_name
        for hf_name, shape in shapes.items():
            if hf_name in used:
                continue
            if hf_name.endswith(SKIPPED_TENSOR_SUFFIXES):
                continue
            if hf_name.startswith("model.layers.") and (block := TensorName.from_hf(hf_name).block) is not None \
                    and block >= self.n_layers:
                # multi-token-prediction layers past num_hidden_layers (DeepSeek-V3): the
                # converter skips them too
                logger.debug("%s: skipping %s (layer >= num_hidden_layers)", self.folder, hf_name)
                continue
            if hf_name.startswith("lm_head.") and self.tied:
                logger.info("%s: tie_word_embeddings, not writing %s", self.folder, hf_name)
                continue
            gguf_name = hf_to_gguf_name(self.arch, self.n_layers, hf_moe.lookup_name(hf_name))
            if gguf_name is None:
                unmapped.append(hf_name)
                continue
            quantizable = len(shape) >= 2 and gguf_name.endswith(".weight") and not hf_moe.is_router(gguf_name)
            st = SourceTensor(gguf_name, hf_moe.memory_name(self.hf_arch, hf_name), shape, quantizable=quantizable)
            tensors.append((self._order_key(gguf_name), st))
            hf_of[gguf_name] = hf_name
        self._check_index(tensors, unmapped)
        if str(self.rope.get("rope_type", self.rope.get("type", ""))).lower() == "llama3":
            n = self._rope_dim() // 2
            tensors.append((self._order_key("rope_freqs.weight"), SourceTensor("rope_freqs.weight", None, (n,), False)))
        tensors.sort(key=lambda kt: kt[0])
        return [st for _, st in tensors], hf_of

    def _check_index(self, tensors: list[tuple[tuple, SourceTensor]], unmapped: list[str], what: str = "tensors") -> None:
        """Raise ValueError (naming the folder) for checkpoint tensors with no GGUF name, no token
        embedding, or an untied model without lm_head.weight."""
        if unmapped:
            raise ValueError(f"{self.folder}: {what} with no GGUF name for {self.arch}: {', '.join(sorted(unmapped)[:10])}")
        names = {st.gguf_name for _, st in tensors}
        if "token_embd.weight" not in names:
            raise ValueError(f"{self.folder}: no token embedding (model.embed_tokens.weight)")
        if not self.tied and "output.weight" not in names:
            raise ValueError(f"{self.folder}: tie_word_embeddings is false but there is no lm_head.weight")

    @staticmethod
    def _order_key(gguf_name: str) -> tuple:
        # token_embd first, then the blocks in order, then output_norm/output/rope_freqs.
        parts = gguf_name.split(".")
        if parts[0] == "blk":
            return (1, int(parts[1]), gguf_name)
        return (0 if parts[0] == "token_embd" else 2, 0, gguf_name)

    def _rope_dim(self) -> int:
        head_dim = self.hparams.get("head_dim")
        return int(head_dim) if head_dim else int(self.hparams["hidden_size"]) // self.n_head

    # -- TensorSource ---------------------------------------------------------------------

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def read(self, t: SourceTensor) -> torch.Tensor:
        """One tensor as float32 of shape ``t.shape``.

        q_proj/k_proj weights and biases of the ``llama`` architecture come permuted to
        llama.cpp's row order (heads of ``(2, head_dim/2)`` rows become ``(head_dim/2, 2)``).

        Raises:
            KeyError: the tensor is not in this checkpoint.
        """
        if t.gguf_name == "rope_freqs.weight" and t.hf_name is None:
            return self._llama3_rope_factors()
        if (comp := self._composites.get(t.gguf_name)) is not None:
            return comp.read(self._read_hf)
        return self._read_plain(t, self._hf_of[t.gguf_name])

    def model_rows(self, t: SourceTensor) -> tuple[str, torch.Tensor | None] | None:
        """A plain checkpoint tensor (not a composite: stacked experts, MLA splits) is its parameter, its rows
        permuted for ``llama``'s q/k (:func:`permute_qk` of the row indices); see ``TensorSource.model_rows``."""
        hf_name = self._hf_of.get(t.gguf_name)
        if t.gguf_name in self._composites or hf_name is None or hf_name != t.hf_name:
            return None
        n_head = self._qk_heads(hf_name)
        return hf_name, None if n_head is None else permute_qk(torch.arange(t.shape[0]), n_head)

    def _qk_heads(self, hf_name: str) -> int | None:
        """The heads :func:`permute_qk` takes for a tensor :meth:`read` permutes (``llama``'s q_proj / k_proj weight
        and bias), else None."""
        if self.arch != "llama":
            return None
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return self.n_head
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return self.n_head_kv
        return None

    def _read_plain(self, t: SourceTensor, hf_name: str, device: str | torch.device | None = None) -> torch.Tensor:
        """A checkpoint tensor that is not a composite, as float32 (on ``device``, moved as stored and converted
        there), q/k permuted for ``llama``, its shape checked."""
        x = self._read_hf(hf_name, device)
        if (n_head := self._qk_heads(hf_name)) is not None:
            x = permute_qk(x, n_head)
        if tuple(x.shape) != t.shape:
            raise ValueError(f"{hf_name}: read shape {tuple(x.shape)}, expected {t.shape}")
        return x.contiguous()

    def _packable(self, t: SourceTensor):
        """The per-expert members of a stacked expert tensor stored in a packable dtype (same for all), else None."""
        comp = self._composites.get(t.gguf_name)
        if not isinstance(comp, hf_moe.ExpertStack):
            return None
        dtypes = {self._dtypes.get(m) for m in comp.members}
        return comp.members if len(dtypes) == 1 and dtypes.pop() in _PACKED_ITEMSIZE else None

    def read_stored(self, t: SourceTensor, lo: int = 0, hi: int | None = None):
        """Experts ``lo .. hi - 1`` of a stacked expert tensor as stored (per-expert BF16 / FP16 / F32 tensors, or
        FP8 with their ``weight_scale_inv``), read one expert at a time; see ``TensorSource.read_stored``.

        Raises:
            ValueError: an expert read back in another shape.
        """
        from dynaquant.sources.experts import Stored

        members = self._packable(t)
        if members is None:
            return super().read_stored(t, lo, hi)
        values, scales = [], []
        for name in members[lo:hi]:
            x = self._reader.get_tensor(self._files[name], name)
            if tuple(x.shape) != tuple(t.shape[1:]):
                raise ValueError(f"{name}: read shape {tuple(x.shape)}, expected {tuple(t.shape[1:])}")
            values.append(x)
            if (scale := self._fp8_scale.get(name)) is not None:
                scales.append(self._reader.get_tensor(self._files[scale], scale).to(torch.float32))
        if scales and len(scales) != len(values):
            return super().read_stored(t, lo, hi)
        block = tuple(self._fp8_block) if scales and self._fp8_block else None
        if scales and block is None:  # a per-tensor FP8 scale: decoded as read
            return super().read_stored(t, lo, hi)
        return Stored(torch.stack(values), torch.stack(scales) if scales else None, block)

    def stored_bytes(self, t: SourceTensor) -> int:
        members = self._packable(t)
        if members is None:
            return super().stored_bytes(t)
        n = t.numel * _PACKED_ITEMSIZE[self._dtypes[members[0]]]
        if members[0] in self._fp8_scale and self._fp8_block:
            b0, b1 = self._fp8_block
            n += 4 * t.shape[0] * -(-t.shape[1] // b0) * -(-t.shape[2] // b1)
        return n

    def read_to(self, t: SourceTensor, device: str | torch.device) -> torch.Tensor:
        """:meth:`read` onto ``device``: a plain checkpoint tensor (BF16 / F16 / F32, or FP8 with its scales) is moved
        as stored and converted (dequantized, q/k permuted) there: the same float32 values, bit for bit."""
        hf_name = getattr(self, "_hf_of", {}).get(t.gguf_name)
        if t.gguf_name in self._composites or hf_name not in getattr(self, "_files", {}) \
                or self._dtypes.get(hf_name) not in _PACKED_ITEMSIZE:
            return super().read_to(t, device)
        return self._read_plain(t, hf_name, device)

    def reads_experts(self, t: SourceTensor) -> bool:
        return self._packable(t) is not None

    def file_of(self, t: SourceTensor) -> str:
        """The ``*.safetensors`` (or ``*.bin``) file holding the tensor, else the folder."""
        f = getattr(self, "_files", {}).get(t.hf_name) if t.hf_name else None
        return str(f) if f is not None else self.source_id

    def _fold_quantization_tensors(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Drop the scale tensors of a block-FP8 checkpoint from the tensor list (they are read
        with their weights, see :mod:`.hf_dequant`) and the unused activation scales.

        Raises:
            ValueError: FP8 scales in a checkpoint whose ``quantization_config`` is not ``fp8``.
        """
        qc = self.config.get("quantization_config") or {}
        self._fp8_scale: dict[str, str] = {}
        self._fp8_block = qc.get("weight_block_size")
        out = {}
        for name, shape in shapes.items():
            if name.endswith(hf_dequant.FP8_SCALE_SUFFIX) and name[: -len(hf_dequant.FP8_SCALE_SUFFIX)] in shapes:
                if qc.get("quant_method") != "fp8":
                    raise ValueError(f"{self.folder / 'config.json'}: {name} found but quantization_config.quant_method "
                                     f"is {qc.get('quant_method')!r}; only block-scaled 'fp8' scales are supported")
                self._fp8_scale[name[: -len(hf_dequant.FP8_SCALE_SUFFIX)]] = name
            elif not name.endswith(hf_dequant.UNUSED_SUFFIXES):
                out[name] = shape
        if self._fp8_scale:
            logger.info("%s: %d FP8 weights (blocks %s), dequantized on reading", self.folder, len(self._fp8_scale),
                        self._fp8_block)
        return out

    def _read_hf(self, hf_name: str, device: str | torch.device | None = None) -> torch.Tensor:
        """One checkpoint tensor in float32 (block-FP8 weights dequantized), moved to ``device`` as stored and
        converted there (None: on the CPU); packed uint8 data (MXFP4 blocks and scales) is returned as stored, for
        its reader to decode."""
        x = self._reader.get_tensor(self._files[hf_name], hf_name)
        if device is not None:
            x = x.to(device)
        if x.dtype == torch.uint8:
            return x
        if (scale := self._fp8_scale.get(hf_name)) is not None:
            return hf_dequant.dequant_block_fp8(x, self._reader.get_tensor(self._files[scale], scale).to(x.device),
                                                self._fp8_block)
        return x.to(torch.float32)

    def _llama3_rope_factors(self) -> torch.Tensor:
        # Llama 3.1 frequency-dependent RoPE scaling, as LlamaModel.generate_extra_tensors.
        rp = self.rope
        base = float(rp.get("rope_theta", self.hparams.get("rope_theta", 10000.0)))
        dim = self._rope_dim()
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = float(rp.get("factor", 8.0))
        low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
        old_ctx = float(rp.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        out = []
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                out.append(1.0 / ((1 - smooth) / factor + smooth))
        return torch.tensor(out, dtype=torch.float32)

    def add_metadata(self, writer: GGUFWriter) -> None:
        """general.*, the architecture hyper-parameters and the tokenizer (see the module doc).

        Raises:
            ValueError: the folder has no tokenizer gguf-py can read, or the tokenizer has
                more tokens than ``vocab_size``.
        """
        total = sum(t.numel for t in self._tensors)
        writer.add_type(gguf.GGUFType.MODEL)
        meta = gguf.Metadata.load(None, self.folder, None, total)
        if meta.name is None:
            meta.name = self.folder.name
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(total, 0, 0, 0)
        meta.set_gguf_meta_model(writer)
        self._add_hparams(writer)
        self._add_tokenizer(writer)

    def _add_hparams(self, w: GGUFWriter) -> None:
        hp = self.hparams
        w.add_block_count(self.n_layers)
        if (n_ctx := hp.get("max_position_embeddings")) is not None:
            w.add_context_length(int(n_ctx))
        w.add_embedding_length(int(hp["hidden_size"]))
        if (n_ff := hp.get("intermediate_size")) is not None:
            w.add_feed_forward_length(int(n_ff))
        w.add_head_count(self.n_head)
        mla = self.arch == "deepseek2"  # MLA: head sizes and rope dims from hf_moe.add_deepseek2_hparams
        if not mla:
            w.add_head_count_kv(self.n_head_kv)
        rp = self.rope
        if (theta := rp.get("rope_theta", hp.get("rope_theta"))) is not None:
            w.add_rope_freq_base(float(theta))
        self._add_rope_scaling(w, rp)
        if (eps := hp.get("rms_norm_eps")) is not None:
            w.add_layer_norm_rms_eps(float(eps))
        if (head_dim := hp.get("head_dim")) is not None and not mla:
            w.add_key_length(int(head_dim))
            w.add_value_length(int(head_dim))
        w.add_vocab_size(int(hp["vocab_size"]))
        if not mla:
            w.add_rope_dimension_count(self._rope_dim())
        hf_moe.add_moe_hparams(w, self.arch, hp)
        if mla:
            hf_moe.add_deepseek2_hparams(w, hp, self.hf_arch)
        elif self.arch == "gpt-oss":
            hf_moe.add_gpt_oss_hparams(w, hp)

    def _add_rope_scaling(self, w: GGUFWriter, rp: dict[str, Any]) -> None:
        rope_type = rp.get("rope_type", rp.get("type"))
        factor = rp.get("factor")
        if rope_type in (None, "default"):
            return
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(factor))
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(factor))
            w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
            if rp.get("truncate") is False:
                logger.warning("%s: YaRN with truncate=False; llama.cpp always rounds the correction range to whole "
                               "dims, so its RoPE differs slightly from transformers'", self.folder)
            if (v := rp.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(float(v))
            if (v := rp.get("attention_factor", rp.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(float(v))
            if (v := rp.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(float(v))
            if (v := rp.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(float(v))
        elif str(rope_type).lower() == "llama3":
            pass  # written as the rope_freqs.weight tensor
        else:
            logger.warning("%s: RoPE scaling type %r is not converted; llama.cpp will run without it",
                           self.folder, rope_type)

    # -- tokenizer ------------------------------------------------------------------------

    def _add_tokenizer(self, w: GGUFWriter) -> None:
        vocab_size = int(self.hparams["vocab_size"])
        tok_cfg_path = self.folder / "tokenizer_config.json"
        tok_cfg = read_json_object(tok_cfg_path) if tok_cfg_path.is_file() else {}
        if self.arch == "llama":
            add_prefix = tok_cfg.get("add_prefix_space")
            if add_prefix is None:
                add_prefix = self._byte_level_prefix_space()
            if add_prefix is not None:
                w.add_add_space_prefix(bool(add_prefix))
        try:
            bpe = gguf.BpeVocab(self.folder)
        except FileNotFoundError:
            bpe = None
        if bpe is not None:
            tokens, types = self._bpe_tokens(bpe, vocab_size)
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(self._bpe_pre())
            w.add_token_list(tokens)
            w.add_token_types(types)
            special = gguf.SpecialVocab(self.folder, load_merges=True, n_vocab=len(tokens))
        else:
            try:
                spm = gguf.LlamaHfVocab(self.folder)
            except (FileNotFoundError, TypeError) as e:
                raise ValueError(
                    f"{self.folder}: no tokenizer gguf-py can convert (needs a byte-level BPE or a Llama-style "
                    f"tokenizer.json): {e}"
                ) from e
            tokens, scores, types = [], [], []
            for text, score, toktype in spm.all_tokens():
                tokens.append(text)
                scores.append(float(score))
                types.append(int(toktype))
            if len(tokens) > vocab_size:
                raise ValueError(f"{self.folder}: tokenizer has {len(tokens)} tokens, vocab_size is {vocab_size}")
            for i in range(len(tokens), vocab_size):
                tokens.append(f"[PAD{i}]".encode())
                scores.append(-1000.0)
                types.append(int(TokenType.UNUSED))
            w.add_tokenizer_model("llama")
            w.add_tokenizer_pre("default")
            w.add_token_list(tokens)
            w.add_token_scores(scores)
            w.add_token_types(types)
            special = gguf.SpecialVocab(self.folder, n_vocab=len(tokens))
        self._fill_add_special(special)
        special.add_to_gguf(w, quiet=True)

    def _byte_level_prefix_space(self) -> bool | None:
        # The converter takes add_prefix_space from tokenizer_config.json; tokenizers saved by
        # transformers 5 keep it only in tokenizer.json's ByteLevel pre-tokenizer.
        tj_path = self.folder / "tokenizer.json"
        if not tj_path.is_file():
            return None
        pre = read_json_object(tj_path).get("pre_tokenizer") or {}
        for p in pre.get("pretokenizers", [pre]):
            if p and p.get("type") == "ByteLevel" and "add_prefix_space" in p:
                return bool(p["add_prefix_space"])
        return None

    def _bpe_pre(self) -> str:
        try:
            tok = self._hf_tokenizer()
        except RemoteCodeError:
            raise  # the checkpoint's own tokenizer code is needed: never fall back silently
        except Exception as e:  # noqa: BLE001 - identification is best effort, as for unknown hashes
            logger.warning("%s: transformers cannot load the tokenizer (%s); writing tokenizer.ggml.pre='default'",
                           self.folder, e)
            return "default"
        return identify_bpe_pre_tokenizer(tok)

    def _hf_tokenizer(self):
        if getattr(self, "_tok", None) is None:
            from transformers import AutoTokenizer

            self._tok = from_pretrained(AutoTokenizer, self.folder, trust_remote_code=self.trust_remote_code)
        return self._tok

    def _bpe_tokens(self, bpe: gguf.BpeVocab, vocab_size: int) -> tuple[list[str], list[int]]:
        """Token strings and types of a byte-level BPE vocabulary, as ``get_vocab_base``:
        added tokens are CONTROL when special (or looking special), else USER_DEFINED
        (with SentencePiece spaces pre-normalised); ids missing up to ``vocab_size`` are
        ``[PAD{i}]`` UNUSED."""
        added: dict[int, tuple[str, bool]] = {}
        tj_path = self.folder / "tokenizer.json"
        if tj_path.is_file():
            for a in read_json_object(tj_path).get("added_tokens") or []:
                added[int(a["id"])] = (a["content"], bool(a.get("special", False)))
        tokens: list[str] = []
        types: list[int] = []
        for i, (text, _score, _type) in enumerate(bpe.all_tokens()):
            text = text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else text
            if i in added:
                content, special = added[i]
                if special or _looks_special(content):
                    types.append(int(TokenType.CONTROL))
                else:
                    content = content.replace("\u2581", " ")
                    types.append(int(TokenType.USER_DEFINED))
                tokens.append(content)
            else:
                types.append(int(TokenType.NORMAL))
                tokens.append(text)
        if len(tokens) > vocab_size:
            raise ValueError(f"{self.folder}: tokenizer has {len(tokens)} tokens, vocab_size is {vocab_size}")
        for i in range(len(tokens), vocab_size):
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
        return tokens, types

    def _fill_add_special(self, special: gguf.SpecialVocab) -> None:
        # SpecialVocab reads add_bos/add_eos from tokenizer_config.json or the post-processor
        # template; where neither says, take them from what the HF tokenizer actually does.
        if "bos" in special.add_special_token and "eos" in special.add_special_token:
            return
        try:
            tok = self._hf_tokenizer()
            with_special = list(tok.encode("a", add_special_tokens=True))
            plain = list(tok.encode("a", add_special_tokens=False))
        except Exception as e:  # noqa: BLE001
            logger.warning("%s: cannot load the HF tokenizer to find add_bos/add_eos (%s)", self.folder, e)
            return
        bos, eos = special.special_token_ids.get("bos"), special.special_token_ids.get("eos")
        special.add_special_token.setdefault("bos", bos is not None and with_special[:1] == [bos] and plain[:1] != [bos])
        special.add_special_token.setdefault("eos", eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos])


def permute_qk(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Permute q_proj/k_proj rows from HF's rotate-half RoPE layout to llama.cpp's (the
    converter's ``LlamaModel.permute``).

    Args:
        x: (n_head * head_dim, ...) weight or (n_head * head_dim,) bias.
        n_head: heads of this projection (``num_key_value_heads`` for k_proj).
    Returns:
        Same shape; within each head, row ``j * (head_dim/2) + i`` moves to ``2 * i + j``.
    """
    rows = x.shape[0]
    return x.reshape(n_head, 2, rows // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def unpermute_qk(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk` (llama.cpp's q/k row order back to HF's), same arguments."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
