"""Qwen2-VL / Qwen2.5-VL to GGUF: the language model (``qwen2vl``) and the mmproj (``clip``) file.

Oracles: transformers (the reference model, its image processor and its M-RoPE positions) and
llama.cpp through llama-cpp-python: ``llama_cpp.Llama`` loads the text model, libmtmd
(``llama_cpp.mtmd_cpp``) loads the mmproj beside it, preprocesses an image, encodes it and
decodes text + image chunks with M-RoPE positions.

The checkpoints are tiny and random (text hidden 256, 2 blocks; vision width 64, 2 blocks) with
a trained 300-token BPE tokenizer holding Qwen2-VL's special tokens. Images are 112x112 (Qwen2-VL)
or 224x224 (Qwen2.5-VL: four 112-pixel attention windows) random RGB: multiples of
``patch_size * spatial_merge_size = 28`` within both preprocessors' pixel limits, so neither
resizes and both see the same pixels.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader

from dynaquant.exporters.gguf.mmproj import open_mmproj_source, write_mmproj
from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.quant import get_format
from dynaquant.sources.hf_vl import HFQwen2VLSource, vl_legacy_name, vl_param_name
from dynaquant.sources.open import open_hf_source

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
TOK = {t: i for i, t in enumerate(SPECIAL)}  # the trainer gives special tokens the first ids
F32 = get_format("F32")


def _f32(t, x, fmt):
    return x.numpy()


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = "The quick brown fox jumps over the lazy dog. Describe this picture of a red square. "
    tk.train_from_iterator([text] * 20, trainer)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }))


def _tiny_vl_checkpoint(folder: Path, qwen25: bool = False, tied: bool = False) -> torch.nn.Module:
    """A random Qwen2-VL (or Qwen2.5-VL) checkpoint with tokenizer and image processor config
    (``tied``: tie_word_embeddings, as Qwen2-VL-2B)."""
    import transformers

    text = dict(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0},
                bos_token_id=None, eos_token_id=TOK["<|im_end|>"], tie_word_embeddings=tied)
    ids = dict(image_token_id=TOK["<|image_pad|>"], video_token_id=TOK["<|video_pad|>"],
               vision_start_token_id=TOK["<|vision_start|>"], vision_end_token_id=TOK["<|vision_end|>"])
    if qwen25:
        cls = transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=4, hidden_size=64, intermediate_size=96, out_hidden_size=256, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                      hidden_act="silu")
    else:
        cls = transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=64, hidden_size=256, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
    config = cls.config_class(text_config=text, vision_config=vision, tie_word_embeddings=tied, **ids)
    config.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # every value random, so a misplaced norm, bias or row shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    _tiny_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2,
    }))
    return model


def test_vl_names():
    assert vl_param_name("model.layers.1.mlp.up_proj.weight") == "model.language_model.layers.1.mlp.up_proj.weight"
    assert vl_param_name("visual.blocks.0.attn.qkv.bias") == "model.visual.blocks.0.attn.qkv.bias"
    assert vl_param_name("model.visual.merger.mlp.0.weight") == "model.visual.merger.mlp.0.weight"
    assert vl_param_name("lm_head.weight") == "lm_head.weight"
    assert vl_legacy_name("model.language_model.norm.weight") == "model.norm.weight"
    assert vl_legacy_name("model.visual.patch_embed.proj.weight") == "visual.patch_embed.proj.weight"


def _random_image(size: int, seed: int) -> np.ndarray:
    """(size, size, 3) uint8 random RGB (smooth blocks plus noise, so resizing would show)."""
    g = np.random.default_rng(seed)
    base = g.integers(0, 256, (size // 14, size // 14, 3)).repeat(14, 0).repeat(14, 1)
    return np.clip(base + g.integers(-40, 41, base.shape), 0, 255).astype(np.uint8)


def _hf_image_logits(model, folder: Path, prefix: list[int], suffix: list[int], image: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """transformers' last-position logits (vocab,) for ``prefix <|vision_start|> image <|vision_end|> suffix``,
    and the input ids (image pads included)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(folder)
    px = proc(images=[Image.fromarray(image)], return_tensors="pt")
    grid = px["image_grid_thw"]
    n_img = int(grid.prod()) // 4  # spatial_merge_size**2 patches per token
    ids = prefix + [TOK["<|vision_start|>"]] + [TOK["<|image_pad|>"]] * n_img + [TOK["<|vision_end|>"]] + suffix
    types = [int(i == TOK["<|image_pad|>"]) for i in ids]  # the processor's mm_token_type_ids: 1 = image
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), pixel_values=px["pixel_values"], image_grid_thw=grid,
                    mm_token_type_ids=torch.tensor([types]))
    return out.logits[0, -1].numpy(), ids


class _Mtmd:
    """A llama.cpp text model with its mmproj loaded by libmtmd (one CPU thread)."""

    def __init__(self, lm_path: Path, mmproj_path: Path):
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.lc, self.mt = llama_cpp, mtmd_cpp
        # F32 KV cache and no flash attention (its CPU path rounds K/V to F16), in the text
        # model and in the vision encoder: the comparison then sees the conversion, not F16
        self.llm = llama_cpp.Llama(model_path=str(lm_path), n_ctx=512, n_batch=512, n_threads=1, verbose=False,
                                   type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                                   flash_attn_type=llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params = mtmd_cpp.mtmd_context_params_default()
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.use_gpu = False
        params.n_threads = 1
        params.print_timings = False
        params.warmup = False
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj_path).encode(), self.llm.model, params)
        if not self.ctx:
            self.llm.close()
            raise RuntimeError(f"libmtmd could not load {mmproj_path}")

    def close(self) -> None:
        self.mt.mtmd_free(self.ctx)
        self.llm.close()

    def run(self, text: str, image: np.ndarray) -> tuple[np.ndarray, list[list[int] | int]]:
        """Last-position logits (vocab,) of ``text`` (with one media marker) and ``image``
        ((H, W, 3) uint8), and the chunks as mtmd made them: token lists for text, the number
        of embeddings for the image."""
        mt, lc = self.mt, self.lc
        h, w, _ = image.shape
        data = np.ascontiguousarray(image).tobytes()
        bitmap = mt.mtmd_bitmap_init(w, h, (ctypes.c_ubyte * len(data)).from_buffer_copy(data))
        chunks = mt.mtmd_input_chunks_init()
        try:
            raw = text.replace("<image>", mt.mtmd_default_marker().decode()).encode()
            inp = mt.mtmd_input_text()
            inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), False, True
            rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
            assert rc == 0, f"mtmd_tokenize: {rc}"
            layout: list[list[int] | int] = []
            for i in range(mt.mtmd_input_chunks_size(chunks)):
                c = mt.mtmd_input_chunks_get(chunks, i)
                if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    p = mt.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                    layout.append([p[j] for j in range(n.value)])
                else:
                    layout.append(int(mt.mtmd_input_chunk_get_n_tokens(c)))
            self.llm._ctx.kv_cache_clear()
            new_n_past = lc.llama_pos(0)
            rc = mt.mtmd_helper_eval_chunks(self.ctx, self.llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past))
            assert rc == 0, f"mtmd_helper_eval_chunks: {rc}"
            n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.llm.model))
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.llm.ctx, -1), shape=(n_vocab,)).copy()
            return logits, layout
        finally:
            mt.mtmd_input_chunks_free(chunks)
            mt.mtmd_bitmap_free(bitmap)


def _llama_text_logits(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn_type=llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    try:
        llm.eval(ids)
        return np.asarray(llm.scores[: len(ids)])
    finally:
        llm.close()


def _write_both(ckpt: Path, out: Path, mmproj_ftype: str = "F32") -> tuple[Path, Path]:
    src = open_hf_source(ckpt)
    lm = out / "lm.gguf"
    write_gguf(lm, src, {t.gguf_name: F32 for t in src.tensors()}, _f32, {},
               file_type=gguf.LlamaFileType.ALL_F32, progress=False)
    mm = write_mmproj(ckpt, out / "mmproj.gguf", ftype=mmproj_ftype)
    return lm, mm


@pytest.mark.parametrize("qwen25", [False, True], ids=["qwen2vl", "qwen2.5vl"])
def test_tiny_vl_runs_in_llama_cpp(qwen25, tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llama_cpp.mtmd_cpp")
    ckpt = tmp_path / "ckpt"
    model = _tiny_vl_checkpoint(ckpt, qwen25=qwen25)
    src = open_hf_source(ckpt)
    assert isinstance(src, HFQwen2VLSource) and src.arch == "qwen2vl"
    assert src.mrope_section == [8, 12, 12, 0]
    for t in src.tensors():  # hf_name is the loaded model's parameter, values unchanged
        assert torch.equal(src.read(t), model.get_parameter(t.hf_name).detach()), t.gguf_name
    assert not any(t.gguf_name.startswith("v.") for t in src.tensors())

    lm, mm = _write_both(ckpt, tmp_path)
    r = GGUFReader(lm)
    assert r.fields["general.architecture"].contents() == "qwen2vl"
    assert r.fields["qwen2vl.rope.dimension_sections"].contents() == [8, 12, 12, 0]
    del r
    r = GGUFReader(mm)
    assert r.fields["general.architecture"].contents() == "clip"
    assert r.fields["general.type"].contents() == "mmproj"
    assert r.fields["clip.projector_type"].contents() == ("qwen2.5vl_merger" if qwen25 else "qwen2vl_merger")
    assert r.fields["clip.vision.projection_dim"].contents() == 256
    if qwen25:
        assert r.fields["clip.vision.n_wa_pattern"].contents() == 2
        assert r.fields["clip.use_silu"].contents() is True
    names = {t.name for t in r.tensors}
    assert {"v.patch_embd.weight", "v.patch_embd.weight.1", "v.blk.1.attn_v.bias", "mm.0.weight", "mm.2.bias",
            "v.post_ln.weight"} <= names
    assert ("v.blk.0.ffn_gate.weight" in names) == qwen25
    del r

    # text only: llama.cpp's logits against transformers' (as the dense tiny-model test)
    ids = [TOK["<|im_start|>"], 40, 7, 266, 290, 99, 283, 5, 299, 12, TOK["<|im_end|>"]]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = _llama_text_logits(lm, ids)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)  # measured 1e-4 * max

    # text + image through libmtmd, against transformers on the same pixels
    size = 224 if qwen25 else 112
    prefix_text, suffix_text = "<|im_start|>Describe this picture", " of a red square<|im_end|>"
    mtmd = _Mtmd(lm, mm)
    try:
        results = []
        for seed in (1, 2):
            image = _random_image(size, seed)
            # mtmd wraps the image in <|vision_start|> ... <|vision_end|> itself
            got, layout = mtmd.run(f"{prefix_text}<image>{suffix_text}", image)
            assert len(layout) == 3 and layout[1] == (size // 28) ** 2, layout
            prefix, suffix = layout[0][:-1], layout[2][1:]  # mtmd's text chunks hold the vision start/end
            assert layout[0][-1] == TOK["<|vision_start|>"] and layout[2][0] == TOK["<|vision_end|>"]
            ref, hf_ids = _hf_image_logits(model, ckpt, prefix, suffix, image)
            assert np.isfinite(got).all()
            assert got.argmax() == ref.argmax()
            # measured (F32 mmproj, F32 KV cache): max |diff| 1.4e-3..2.6e-3 (Qwen2-VL) and 5.8e-3..6.2e-3
            # (Qwen2.5-VL) for logits of max |x| ~5, against 6e-4 text-only: ggml's CPU GELU and quick-GELU
            # run through F16 lookup tables (vision MLPs, merger MLP); a wrong layout, position or window
            # would show as O(1) errors (two images differ by 2.4..5.7)
            np.testing.assert_allclose(got, ref, atol=3e-3 * np.abs(ref).max(), rtol=0)
            results.append(got)
        assert np.abs(results[0] - results[1]).max() > 0.05 * np.abs(results[0]).max()  # the image matters
    finally:
        mtmd.close()


def test_mmproj_f16_types(tmp_path):
    """F16 mmproj (the default): matrices and the patch embedding F16, norms and biases F32, values
    within F16 rounding of the checkpoint."""
    ckpt = tmp_path / "ckpt"
    model = _tiny_vl_checkpoint(ckpt)
    src = open_mmproj_source(ckpt)
    out = write_mmproj(ckpt, tmp_path / "mmproj-f16.gguf")
    r = GGUFReader(out)
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    by_name = {t.gguf_name: t for t in src.tensors()}
    qkv = model.get_parameter("model.visual.blocks.1.attn.qkv.weight").detach()
    conv = model.get_parameter("model.visual.patch_embed.proj.weight").detach()
    for rt in r.tensors:
        t = by_name[rt.name]
        want = gguf.GGMLQuantizationType.F16 if len(t.shape) >= 2 else gguf.GGMLQuantizationType.F32
        assert rt.tensor_type == want, rt.name
        x = torch.from_numpy(np.array(rt.data, dtype=np.float32)).reshape(t.shape)
        ref = src.read(t)
        ref = ref.half().float() if want == gguf.GGMLQuantizationType.F16 else ref
        torch.testing.assert_close(x, ref, rtol=0, atol=0, msg=rt.name)
    k = torch.from_numpy(np.array([t for t in r.tensors if t.name == "v.blk.1.attn_k.weight"][0].data, dtype=np.float32))
    torch.testing.assert_close(k.reshape(64, 64), qkv[64:128].half().float(), rtol=0, atol=0)
    p1 = torch.from_numpy(np.array([t for t in r.tensors if t.name == "v.patch_embd.weight.1"][0].data, dtype=np.float32))
    torch.testing.assert_close(p1.reshape(64, 3, 14, 14), conv[:, :, 1].half().float(), rtol=0, atol=0)
    del r
    with pytest.raises(ValueError, match="mmproj ftype"):
        write_mmproj(ckpt, tmp_path / "x.gguf", ftype="Q4_K")


def test_pipeline_quantize_writes_lm_and_mmproj(tmp_path):
    """``dynaquant quantize <qwen2vl folder>``: a quantized language model plus ``mmproj-<name>`` (F16)
    beside it, both run by llama.cpp on an image + text prompt."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from dynaquant.analysis.imatrix import Imatrix
    from dynaquant.pipeline.quantize import quantize
    from dynaquant.pipeline.source import imatrix_by_gguf_name

    ckpt = tmp_path / "ckpt"
    model = _tiny_vl_checkpoint(ckpt)
    # imatrix statistics come keyed by the loaded model's module names (model.language_model.*)
    src = open_hf_source(ckpt)
    im = Imatrix(sums={"model.language_model.layers.1.mlp.down_proj": torch.ones(384),
                       "model.visual.blocks.0.mlp.fc1": torch.ones(64), "lm_head": 2 * torch.ones(256)},
                 counts={"model.language_model.layers.1.mlp.down_proj": 1, "model.visual.blocks.0.mlp.fc1": 1,
                         "lm_head": 1}, chunks=1)
    assert set(imatrix_by_gguf_name(im, src)) == {"blk.1.ffn_down.weight", "output.weight"}

    res = quantize(ckpt, output=tmp_path / "tiny-Q8_0.gguf", preset="Q8_0", use_imatrix=False, progress=False,
                   device="cpu")
    assert res.mmproj == tmp_path / "mmproj-tiny-Q8_0.gguf" and res.to_dict()["mmproj"] == str(res.mmproj)
    r = GGUFReader(res.output)
    assert r.fields["general.architecture"].contents() == "qwen2vl"
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    del r
    r = GGUFReader(res.mmproj)
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    del r

    image = _random_image(112, 3)
    mtmd = _Mtmd(res.output, res.mmproj)
    try:
        got, layout = mtmd.run("<|im_start|>Describe this picture<image> of a red square<|im_end|>", image)
    finally:
        mtmd.close()
    ref, _ = _hf_image_logits(model, ckpt, layout[0][:-1], layout[2][1:], image)
    # Q8_0 text weights (and Q8_0 activations in llama.cpp's matmuls), F16 vision weights: measured
    # max |diff| 0.21 for max |logit| 4.4; text alone shows the same (0.27 of 6.0): it is the Q8_0
    # rounding of a random model (weights 0.1 * N(0, 1), no structure to average it out)
    assert got.argmax() == ref.argmax()
    np.testing.assert_allclose(got, ref, atol=0.1 * np.abs(ref).max(), rtol=0)


def test_vl_module_layout_and_tied_embeddings(tmp_path):
    """A checkpoint stored under the transformers 5 module names (model.language_model.*,
    model.visual.*) converts to the same tensors as the legacy layout; tied embeddings write no
    output.weight and llama.cpp's text logits still match transformers'."""
    pytest.importorskip("llama_cpp")
    import shutil

    from safetensors.torch import load_file, save_file

    legacy = tmp_path / "legacy"
    model = _tiny_vl_checkpoint(legacy, tied=True)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    modern = tmp_path / "modern"
    modern.mkdir()
    for f in legacy.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, modern / f.name)
    state = load_file(legacy / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in state and "visual.blocks.0.attn.qkv.weight" in state
    save_file({vl_param_name(k): v for k, v in state.items()}, modern / "model.safetensors", metadata={"format": "pt"})

    a, b = open_hf_source(legacy), open_hf_source(modern)
    assert a.tensors() == b.tensors()
    assert "output.weight" not in {t.gguf_name for t in a.tensors()}
    for t in a.tensors():
        assert torch.equal(a.read(t), b.read(t)), t.gguf_name
    ma, mb = open_mmproj_source(legacy), open_mmproj_source(modern)
    assert ma.tensors() == mb.tensors()
    for t in ma.tensors():
        assert torch.equal(ma.read(t), mb.read(t)), t.gguf_name
        assert t.hf_name.startswith("model.visual.") and model.get_parameter(t.hf_name) is not None

    lm = tmp_path / "tied.gguf"
    write_gguf(lm, b, {t.gguf_name: F32 for t in b.tensors()}, _f32, {}, file_type=gguf.LlamaFileType.ALL_F32,
               progress=False)
    ids = [TOK["<|im_start|>"], 40, 7, 266, 290, 99, 283, 5, 299, 12]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = _llama_text_logits(lm, ids)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
