"""Vision-language models through analysis, planning and the safetensors runtime.

Qwen2-VL, Qwen2.5-VL (the builders of test_vl_gguf.py), LLaVA (CLIP vision tower + MLP projector +
Llama) and Mllama (Llama 3.2 Vision: local and global ViT stacks, cross-attention text layers): tiny
random checkpoints saved with ``save_pretrained`` plus a tokenizer and processor configs; ``analyze``
with image + text calibration, a dynamic safetensors plan, ``dynaquant.load`` and image + text
``generate``.

Oracles: transformers' own model holding the weights the checkpoint decodes to (the logits of an
image + text prompt must match the DynaLinear model's to float32 rounding), the plan's formats
against the default vision / projector floor and a user rule, and the report figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import dynaquant
from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.vl_calibration import _prompt, load_images, load_processor, synthetic_images
from dynaquant.quant.formats import get_format
from dynaquant.runtime.loader import DynaLinear
from dynaquant.sources.hf_vl_full import open_vl_full_source

# a few cheap formats: INT8 for the vision floor, INT4 for the language model
CANDIDATES = ("INT4_G32", "INT8_G128", "INT8_G32")
VISION_FLOOR_BPW = get_format("INT8_G128").bpw
ARCHS = ("qwen2vl", "qwen25vl", "llava", "mllama")
# bits per weight of the plans: just above what the BF16 embeddings and the vision floor need in these
# tiny models (Qwen2.5-VL's tower has 4 blocks), so the text model still goes below INT8
BPW = {"qwen25vl": 8.9}


def _tokenizer(folder: Path, special: list[str], cfg: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(["The quick brown fox jumps over the lazy dog. Describe this picture of a red square. "] * 20,
                           trainer)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **cfg}))


def _randomize(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # every value random, so a misplaced norm, bias or row shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))


_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}IMG"
             "{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}")


def _tiny_llava(folder: Path, siglip: bool = False) -> None:
    """LLaVA: CLIP vision tower (width 64, 2 layers, 28-pixel images of 2x2 patches), 2-layer MLP
    projector, Llama text model (hidden 256, 2 layers); processor with a chat template. ``siglip``: a
    3-layer SigLIP tower (with its unused pooling head) whose second-to-last layer feeds the projector
    (as LLaVA-1.5 / LLaVA-NeXT do), and a Mistral text model."""
    import transformers

    _tokenizer(folder, ["<unk>", "<s>", "</s>", "<image>", "<pad>"],
               {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    text = dict(model_type="mistral" if siglip else "llama", vocab_size=320, hidden_size=256, intermediate_size=384,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2)
    vision = dict(model_type="siglip_vision_model" if siglip else "clip_vision_model", hidden_size=64,
                  intermediate_size=128, num_hidden_layers=3 if siglip else 2, num_attention_heads=4, image_size=28,
                  patch_size=14, **({} if siglip else {"projection_dim": 64}))
    strategy = "full" if siglip else "default"
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=3,
                                   vision_feature_layer=-2 if siglip else -1, vision_feature_select_strategy=strategy,
                                   projector_hidden_act="gelu")
    cfg.architectures = ["LlavaForConditionalGeneration"]
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    _randomize(model)
    model.save_pretrained(folder)
    if siglip:
        ip = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    else:
        ip = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    transformers.LlavaProcessor(image_processor=ip, tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
                                patch_size=14, vision_feature_select_strategy=strategy,
                                num_additional_image_tokens=0 if siglip else 1,
                                chat_template=_TEMPLATE.replace("IMG", "<image>")).save_pretrained(folder)


def _tiny_mllama(folder: Path) -> None:
    """Mllama: vision width 64, 2 local + 1 global layers, 28-pixel tiles (2 at most); text hidden 256,
    2 layers of which layer 1 is a cross-attention layer; processor with a chat template."""
    import transformers

    _tokenizer(folder, ["<|begin_of_text|>", "<|end_of_text|>", "<|image|>", "<|finetune_right_pad_id|>", "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|finetune_right_pad_id|>"})
    text = dict(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, cross_attention_layers=[1], bos_token_id=0,
                eos_token_id=4, pad_token_id=3)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                  image_size=28, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0], vision_output_dim=128,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    cfg = transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=2)
    cfg.architectures = ["MllamaForConditionalGeneration"]
    model = transformers.MllamaForConditionalGeneration(cfg).eval()
    _randomize(model)
    model.save_pretrained(folder)
    ip = transformers.MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=2)
    transformers.MllamaProcessor(image_processor=ip, tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
                                 chat_template=_TEMPLATE.replace("IMG", "<|image|>")).save_pretrained(folder)


def _build(arch: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if arch.startswith("qwen"):
        from test_vl_gguf import _tiny_vl_checkpoint

        _tiny_vl_checkpoint(folder, qwen25=arch == "qwen25vl")
    elif arch == "llava":
        _tiny_llava(folder)
    else:
        _tiny_mllama(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    return {a: _build(a, root / a) for a in ARCHS}


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    """arch -> (analysis result, quantize result, rule-override plan) for each tiny checkpoint."""
    root = tmp_path_factory.mktemp("vlq")
    out = {}
    for arch, folder in checkpoints.items():
        images = ()
        if arch == "llava":  # one user image file (PIL-written PNG) instead of the synthetic ones
            synthetic_images(3, 40, 56)[2].save(root / "user.png")
            images = (str(root / "user.png"),)
        spec = CalibrationSpec(n_sequences=2, seq_len=48, images=images, n_images=2)
        res = dynaquant.analyze(folder, root / f"{arch}-analysis", calibration=spec, candidates=CANDIDATES,
                                fisher_sequences=4, super_weights=False, device="cpu", progress=False)
        q = dynaquant.quantize(folder, output=root / f"{arch}-q", bpw=BPW.get(arch, 8.6), report=res.report_path,
                               target="safetensors", device="cpu", progress=False)
        override = dynaquant.make_dynamic_plan(res.report_path, bpw=BPW.get(arch, 8.6), target="safetensors",
                                               rules=[r"v\.blk\.1\.=INT4_G32"])
        out[arch] = (res, q, override)
    return out


def _bf16_bytes(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    for p in folder.glob("*.safetensors"):
        with safe_open(str(p), "pt") as f:
            n += sum(int(np.prod(f.get_slice(k).get_shape())) * 2 for k in f.keys())  # noqa: SIM118
    return n


def _image_inputs(folder: Path) -> dict:
    proc = load_processor(folder)
    img = synthetic_images(2, 45, 61)[1]  # odd size: the processor resizes it to its native size
    batch = proc(text=_prompt(proc, "Describe this picture"), images=[img], return_tensors="pt")
    return {k: v for k, v in dict(batch).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("arch", ARCHS)
def test_full_source_names(checkpoints, arch):
    """Vision tower, projector and text tensors all listed, named by their group, hf_name = the loaded
    model's parameter; Mllama's cross-attention layers visible in the names."""
    from transformers import AutoModelForImageTextToText

    ts = open_vl_full_source(checkpoints[arch])
    names = {t.gguf_name: t for t in ts.tensors()}
    model = AutoModelForImageTextToText.from_pretrained(checkpoints[arch])
    params = dict(model.named_parameters())
    assert all(t.hf_name in params and tuple(params[t.hf_name].shape) == t.shape for t in names.values())
    assert len(names) == len({t.hf_name for t in names.values()})
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {t.hf_name.removesuffix(".weight") for t in names.values() if t.quantizable and t.gguf_name != "token_embd.weight"} \
        == linears - ({"lm_head"} if ts.tied else set())
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "mm.0.weight"} <= set(names)
    assert {"v.blk.0.ffn_up.weight", "v.blk.1.ffn_down.weight"} <= set(names)
    assert names["v.blk.1.ffn_down.weight"].quantizable and names["mm.0.weight"].quantizable
    if arch.startswith("qwen"):
        assert "v.blk.0.attn_qkv.weight" in names and "mm.2.weight" in names  # the mmproj GGUF's names
    if arch == "llava":
        assert names["mm.2.weight"].hf_name == "model.multi_modal_projector.linear_2.weight"
    if arch == "mllama":
        assert {f"blk.1.cross_attn_{p}.weight" for p in "qkvo"} <= set(names)
        assert "v.global.blk.0.attn_q.weight" in names and "blk.1.attn_q.weight" not in names
    x = ts.read(names["v.blk.1.ffn_down.weight"])
    torch.testing.assert_close(x, params[names["v.blk.1.ffn_down.weight"].hf_name].detach().float())


@pytest.mark.parametrize("arch", ARCHS)
def test_analysis_measures_vision(quantized, arch):
    """Image + text calibration gives every vision linear and the projector statistics (errors measured)."""
    res = quantized[arch][0]
    rep = res.report
    measured = {t["name"] for t in rep["tensors"] if t["quantizable"] and t["errors"]}
    want = {t["name"] for t in rep["tensors"] if t["quantizable"]}
    assert want == measured
    assert any(n.startswith("v.blk.") for n in measured) and any(n.startswith("mm.") for n in measured)
    vis = [t for t in rep["tensors"] if t["name"].startswith(("v.", "mm.")) and t["errors"]]
    assert all(t["errors"]["INT4_G32"]["kld_pred"] > t["errors"]["INT8_G32"]["kld_pred"] > 0 for t in vis)
    if arch == "llava":
        assert "user.png" in rep["calibration"]["id"]


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_vision_floor_and_override(quantized, arch):
    """Vision tower and projector at INT8 class or wider by default; a user rule lowers one vision layer;
    cross-attention at least the attention floor."""
    _, q, override = quantized[arch]
    fmts = q.plan.formats()
    vis = {n: f for n, f in fmts.items() if n.startswith(("v.", "mm.")) and get_format(f).kind != "float"}
    assert vis and all(get_format(f).bpw >= VISION_FLOOR_BPW for f in vis.values())
    assert any(get_format(f).bpw < VISION_FLOOR_BPW for n, f in fmts.items() if n.startswith("blk."))  # text lower
    ofmt = override.formats()
    assert all(ofmt[n] == "INT4_G32" for n in ofmt if n.startswith("v.blk.1.") and n.endswith(".weight")
               and get_format(ofmt[n]).kind != "float")
    if arch == "mllama":
        assert all(get_format(fmts[f"blk.1.cross_attn_{p}.weight"]).bpw >= get_format("Q4_0").bpw for p in "qkvo")


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_image_text(checkpoints, quantized, arch):
    """dynaquant.load gives the VL model with DynaLinear layers (vision tower and projector included); its
    image + text logits equal transformers' on the decoded weights; generate works and agrees."""
    from transformers import AutoModelForImageTextToText

    q = quantized[arch][1]
    out = Path(q.output)
    assert {"config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert (out / "preprocessor_config.json").is_file() or (out / "processor_config.json").is_file()
    assert q.size_bytes < 0.75 * _bf16_bytes(checkpoints[arch])
    model = dynaquant.load(out, device="cpu")
    assert type(model).__name__.endswith("ForConditionalGeneration")
    dyn = {n for n, m in model.named_modules() if isinstance(m, DynaLinear)}
    assert any(".vision" in n or ".visual." in n for n in dyn) and any("multi_modal_projector" in n or "merger" in n
                                                                       for n in dyn)
    ref = AutoModelForImageTextToText.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    orig = AutoModelForImageTextToText.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        sd = {n: p.float() for n, p in model.named_parameters()}
        sd.update({n + ".weight": m.dequantize() for n, m in model.named_modules() if isinstance(m, DynaLinear)})
        missing, _ = ref.load_state_dict({k: v for k, v in sd.items() if k in ref.state_dict()}, strict=False)
        assert not [k for k in missing if not k.endswith("inv_freq")]
        inputs = _image_inputs(checkpoints[arch])
        a, b, c = model(**inputs).logits, ref(**inputs).logits, orig(**inputs).logits
    diff = float((a - b).abs().max())
    assert diff <= 1e-5 * float(b.abs().max()), diff
    assert float((a - c).abs().max()) > 10 * max(diff, 1e-7)  # the weights really are quantized
    g1 = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    g2 = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert g1.shape[1] == inputs["input_ids"].shape[1] + 4 and torch.equal(g1, g2)
    with torch.no_grad():  # text-only still runs
        assert model(input_ids=inputs["input_ids"][:, :3]).logits.shape[1] == 3


def test_llava_siglip_unused_layers(tmp_path):
    """SigLIP tower read at its second-to-last layer: the last layer and the pooling head are measured with
    zero predicted KLD (no gradient reaches them), still kept at the vision floor; the head's
    MultiheadAttention out_proj (weight read directly) stays unquantized; image + text generate works."""
    folder = tmp_path / "siglip"
    folder.mkdir()
    _tiny_llava(folder, siglip=True)
    names = {t.gguf_name: t for t in open_vl_full_source(folder).tensors()}
    assert not names["v.head.attention.out_proj.weight"].quantizable and names["v.head.mlp.fc1.weight"].quantizable
    res = dynaquant.analyze(folder, tmp_path / "an", calibration=CalibrationSpec(n_sequences=2, seq_len=48),
                            candidates=CANDIDATES, fisher_sequences=4, super_weights=False, device="cpu", progress=False)
    kld = {t["name"]: t["errors"]["INT4_G32"]["kld_pred"] for t in res.report["tensors"] if t["errors"]}
    assert kld["v.blk.2.ffn_down.weight"] == 0 and kld["v.head.mlp.fc2.weight"] == 0
    assert kld["v.blk.1.ffn_down.weight"] > 0 and kld["mm.0.weight"] > 0
    q = dynaquant.quantize(folder, output=tmp_path / "q", bpw=8.7, report=res.report_path, target="safetensors",
                           device="cpu", progress=False)
    assert get_format(q.plan.formats()["v.blk.2.ffn_down.weight"]).bpw >= VISION_FLOOR_BPW
    model = dynaquant.load(q.output, device="cpu")
    inputs = _image_inputs(folder)
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] == inputs["input_ids"].shape[1] + 3


def test_gptq_text_model_vision_plain(checkpoints, quantized, tmp_path):
    """--gptq on a VL checkpoint: the language model's tensors are GPTQ-rounded (text calibration), the
    vision tower and projector, which text-only sequences never reach, are rounded plainly."""
    res, q, _ = quantized["llava"]
    g = dynaquant.quantize(checkpoints["llava"], output=tmp_path / "g", plan=q.plan, report=res.report_path,
                           target="safetensors", device="cpu", progress=False, gptq=True, calibration_chunks=3, n_ctx=48)
    n_text = sum(1 for e in q.plan.entries if e.name.startswith(("blk.", "output.")) and get_format(e.format).kind != "float")
    assert g.gptq and sum(v["tensors"] for v in g.gptq.values()) == n_text
    assert dynaquant.load(g.output, device="cpu")(**_image_inputs(checkpoints["llava"])).logits.isfinite().all()


def test_report_vision_figures(quantized):
    """The HTML report has vision-tower error curves and heat maps; Mllama's cross-attention kinds show."""
    from dynaquant.analysis.report.html import build_report_page
    from dynaquant.analysis.report.plots import layer_error_curves
    from dynaquant.analysis.report.vl import vision_report

    for arch in ARCHS:
        res, q, _ = quantized[arch]
        page = build_report_page(res.report, plan=q.plan.to_dict())
        assert {"fig-vision-layer-kld_pred", "fig-vision-layer-output_rel"} <= set(page.figures), arch
        assert any(f.startswith("fig-vision-plan-") for f in page.figures) and "fig-layer-kld_pred" in page.figures
        vc = layer_error_curves(vision_report(res.report))
        assert vc.layers == {"mllama": [0, 1, 2], "qwen25vl": [0, 1, 2, 3]}.get(arch, [0, 1])
        assert "ffn_down" in vc.by_kind and all(k.startswith("v.") is False for k in vc.by_kind)
        text = layer_error_curves(res.report)
        assert text.layers == [0, 1]
        if arch == "mllama":
            assert {"cross_attn_q", "cross_attn_o"} <= set(text.by_kind)
            assert "global_attn_q" in vc.by_kind


@pytest.mark.parametrize("arch", ["llava", "mllama"])
def test_gguf_refused(checkpoints, arch, tmp_path):
    with pytest.raises(ValueError, match=r"config\.json.*--format safetensors"):
        dynaquant.quantize(checkpoints[arch], output=tmp_path / "x.gguf", preset="Q8_0", device="cpu", progress=False)


def test_qwen2vl_gguf_source_unchanged(checkpoints):
    """The GGUF path still lists only Qwen2-VL's language model."""
    from dynaquant.sources.open import open_hf_source

    names = [t.gguf_name for t in open_hf_source(checkpoints["qwen2vl"]).tensors()]
    assert names and not any(n.startswith(("v.", "mm.")) for n in names)


def test_calibration_images(tmp_path):
    a, b = synthetic_images(4, 30, 44), synthetic_images(4, 30, 44)
    assert [im.size for im in a] == [(44, 30)] * 4
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    assert len({np.asarray(x).tobytes() for x in a}) == 4
    a[0].save(tmp_path / "b.png")
    a[1].save(tmp_path / "a.png")
    (tmp_path / "notes.txt").write_text("x")
    got = load_images([tmp_path])
    assert [np.asarray(g).tolist() == np.asarray(x).tolist() for g, x in zip(got, (a[1], a[0]))] == [True, True]
    with pytest.raises(ValueError, match="missing.png"):
        load_images([tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="notes.txt"):
        load_images([tmp_path / "notes.txt"])
