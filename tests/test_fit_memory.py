"""``--fit-memory``: the KV cache and margin arithmetic (hand-computed sizes, and llama.cpp's own allocation as the
oracle), the shapes read from config.json and GGUF metadata (dense, MoE, MLA), the size handed to the planner, the
plan / result records, and the too-small-memory error. No analysis runs here: plans come from a synthetic report."""

from __future__ import annotations

import json
import re

import gguf
import pytest
from test_moe_gguf import _BASE, MOE, _tiny_moe, _write_f32

from dynaquant.pipeline.fit import config_kv_shape, gguf_kv_shape, kv_shape
from dynaquant.pipeline.source import open_tensor_source, tensor_infos
from dynaquant.quant.fit import GIB, KVShape, MemoryFit, default_margin_bytes, kv_cache_bytes, memory_fit
from dynaquant.quant.plan import Plan, PlanEntry, PlanError
from dynaquant.sources.checkpoint import default_model_path, resolve_source
from dynaquant.sources.gguf import open_gguf_source
from dynaquant.sources.open import open_hf_source

MIB = 2**20
# SmolLM2-135M: 30 layers, 3 KV heads of 64 (embedding 576 / 9 heads; its GGUF has no key_length)
SMOL_F16_8192 = 30 * 2 * 3 * 64 * 8192 * 2  # 188_743_680 bytes = 180 MiB
SMOL_Q8_8192 = 30 * 2 * (3 * 64 // 32 * 34) * 8192  # 100_270_080 bytes: a row of 192 is 6 blocks of 34 bytes


@pytest.fixture(scope="module")
def smol():
    """The default model's tensor source (opened once: parsing its GGUF header is the slow part here)."""
    return open_tensor_source(resolve_source(None))


def _main(capsys, *argv) -> tuple[int, str, str]:
    from dynaquant.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _llama_kv_mib(capfd, path, n_ctx: int, kv_type: str) -> tuple[float, str]:
    """llama.cpp's KV cache of ``path`` at ``n_ctx`` (MiB, as its log prints it) and the log line."""
    llama_cpp = pytest.importorskip("llama_cpp")
    t = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv_type]
    capfd.readouterr()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, verbose=True, type_k=t, type_v=t,
                          flash_attn=True)
    llm.close()
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if re.match(r"llama_kv_cache: size = ", ln))
    return float(re.search(r"size = +([0-9.]+) MiB", line).group(1)), line


# -- the arithmetic ------------------------------------------------------------------------------------------------


def test_default_model_kv_cache_by_hand(smol):
    shape = kv_shape(smol)
    assert shape == KVShape((3,) * 30, 64, 64)
    assert kv_cache_bytes(shape, 8192, "f16") == SMOL_F16_8192 == 180 * MIB
    assert kv_cache_bytes(shape, 8192, "q8_0") == SMOL_Q8_8192
    # llama.cpp pads the context to a multiple of 256 cells
    assert kv_cache_bytes(shape, 1000, "f16") == kv_cache_bytes(shape, 1024, "f16") == 30 * 2 * 192 * 1024 * 2


def test_llama_cpp_allocates_that_cache(capfd):
    path = default_model_path()
    shape = KVShape((3,) * 30, 64, 64)
    for ctx, kv_type in ((8192, "f16"), (1000, "q8_0")):
        mib, line = _llama_kv_mib(capfd, path, ctx, kv_type)
        assert abs(kv_cache_bytes(shape, ctx, kv_type) / MIB - mib) < 0.006, line


def test_margin_default_and_override():
    assert default_margin_bytes(24 * GIB) == 2**29 + 24 * GIB * 4 // 100 == 1_567_663_063
    shape = KVShape((3,) * 30, 64, 64)
    fit = memory_fit(shape, 24 * GIB, 8192, "f16")
    assert (fit.kv_bytes, fit.margin_bytes) == (SMOL_F16_8192, 1_567_663_063)
    assert fit.size_bytes == 24 * GIB - SMOL_F16_8192 - 1_567_663_063
    fit = memory_fit(shape, 24 * GIB, 8192, "q8_0", margin_bytes=0)
    assert fit.size_bytes == 24 * GIB - SMOL_Q8_8192 and fit.margin_bytes == 0
    assert memory_fit(shape, GIB, 100, margin_bytes=5).size_bytes == GIB - 30 * 2 * 192 * 256 * 2 - 5
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_cache_bytes(KVShape((2,), 80, 80), 512, "q8_0")  # llama.cpp refuses such a q8_0 cache too
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kv_cache_bytes(shape, 512, "q4_0")


@pytest.mark.parametrize("case,expected", [
    # qwen3moe: 2 layers x 2 KV heads x head_dim 64 (config.head_dim), f16, 8192 cells
    ("qwen3moe", 2 * 2 * 2 * 64 * 8192 * 2),
    # mixtral: no head_dim: hidden 256 / 4 heads = 64; 2 KV heads
    ("mixtral", 2 * 2 * 2 * 64 * 8192 * 2),
    # DeepSeek-V3 MLA: one compressed K of kv_lora_rank 256 + qk_rope_head_dim 64 per layer, no V
    ("deepseek-v3", 2 * (256 + 64) * 8192 * 2),
    # gpt-oss: sliding-window layers counted full (an upper bound), head_dim 64, 2 KV heads
    ("gpt-oss", 2 * 2 * 2 * 64 * 8192 * 2),
])
def test_tiny_moe_and_mla_configs_by_hand(case, expected):
    hp = {**_BASE, **MOE[case][1]}
    shape = config_kv_shape(hp, "config.json")
    assert kv_cache_bytes(shape, 8192, "f16") == expected
    assert shape.mla == (case == "deepseek-v3")
    q8 = kv_cache_bytes(shape, 8192, "q8_0")
    assert q8 == expected // 2 // 32 * 34  # every row a multiple of 32: 34 bytes a block instead of 64


def test_gguf_metadata_per_layer_heads_and_old_deepseek(tmp_path):
    """Per-layer head_count_kv arrays (0: a layer without a cache), explicit key/value lengths, and a DeepSeek-V2
    GGUF converted before the MLA keys (llama.cpp then caches full K and V of every head)."""
    def reader(arch, **kv):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        for k, v in kv.items():
            getattr(w, f"add_{k}")(v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return gguf.GGUFReader(str(p))

    r = reader("granitehybrid", block_count=4, embedding_length=512, head_count=8, head_count_kv=[2, 0, 2, 0])
    shape = gguf_kv_shape(r, "granitehybrid", "x.gguf")
    assert shape == KVShape((2, 0, 2, 0), 64, 64) and shape.n_layers == 2
    assert kv_cache_bytes(shape, 512, "f16") == 2 * 2 * 2 * 64 * 512 * 2
    r = reader("deepseek2", block_count=3, embedding_length=512, head_count=4, head_count_kv=4, key_length=192,
               value_length=128, kv_lora_rank=256)
    assert kv_cache_bytes(gguf_kv_shape(r, "deepseek2", "x.gguf"), 256, "f16") == 3 * 4 * (192 + 128) * 256 * 2


def test_tiny_mla_checkpoint_and_its_gguf_in_llama_cpp(tmp_path, capfd):
    """The MLA cache from the HF folder, from the GGUF dynaquant writes of it, and as llama.cpp allocates it."""
    ckpt = tmp_path / "ckpt"
    _tiny_moe(ckpt, "deepseek-v3")
    src = open_hf_source(ckpt)
    expected = 2 * (256 + 64) * 8192 * 2  # 2 layers x (kv_lora_rank + rope dim) x cells x f16, no V
    assert kv_cache_bytes(kv_shape(src), 8192, "f16") == expected
    out = tmp_path / "mla.gguf"
    _write_f32(src, out)
    shape = kv_shape(open_gguf_source(out))
    assert shape == KVShape((1, 1), 320, 0, mla=True)
    assert kv_cache_bytes(shape, 8192, "f16") == expected
    mib, line = _llama_kv_mib(capfd, out, 8192, "f16")
    assert abs(expected / MIB - mib) < 0.006 and re.search(r"V \(f16\): +0\.00 MiB", line), line  # V: a view of K


# -- the run -------------------------------------------------------------------------------------------------------


def _synthetic_report(ts) -> dict:
    """A report for the default model without an analysis: every quantizable tensor measured in Q4_0 and Q8_0 with
    made-up errors (Q8_0 the better)."""
    tensors = []
    for t in tensor_infos(ts):
        e = {}
        if t.quantizable:
            e = {f: {"kld_pred": k * (1 + i % 7) / 1e4} for f, k in (("Q4_0", 30.0), ("Q8_0", 1.0))
                 for i in [len(tensors)]}
        tensors.append({"name": t.name, "hf_name": t.hf_name, "shape": list(t.shape), "quantizable": t.quantizable,
                        "errors": e})
    return {"version": 1, "model": {"id": "smollm2", "n_layers": 30}, "candidates": ["Q4_0", "Q8_0"],
            "tensors": tensors}


def test_the_run_plans_for_memory_minus_kv_minus_margin(smol, tmp_path, capsys, monkeypatch):
    import dynaquant.pipeline.analyze as analyze
    import dynaquant.pipeline.quantize as quantize

    report = tmp_path / "report.json"
    report.write_text(json.dumps(_synthetic_report(smol)))
    monkeypatch.setattr(analyze, "run_analysis", lambda *a, **k: pytest.fail("no analysis may run"))
    monkeypatch.setattr(quantize, "write_output", lambda *a: (_ for _ in ()).throw(ValueError("stop before encoding")))
    memory, margin = 400 * MIB, 64 * MIB
    plan_path, out = tmp_path / "plan.json", tmp_path / "o.gguf"
    rc, _, err = _main(capsys, "quantize", "--fit-memory", "400MiB", "--fit-ctx", "8192", "--kv-type", "q8_0",
                       "--margin", "64MiB", "--report", report, "--save-plan", plan_path, "--no-imatrix", "--no-eval",
                       "-o", out)
    assert rc == 2 and "stop before encoding" in err, err
    plan = json.loads(plan_path.read_text())
    size = memory - SMOL_Q8_8192 - margin
    assert plan["budget"] == {"size_bytes": size}
    assert plan["fit"] == {"memory_bytes": memory, "ctx": 8192, "kv_type": "q8_0", "kv_bytes": SMOL_Q8_8192,
                           "margin_bytes": margin, "size_bytes": size, "kv_shape": "30 layers x 3 KV heads x (64 + 64)"}
    assert Plan.from_dict(plan).fit == MemoryFit(**plan["fit"])  # the plan.json reads back
    assert plan["size_bytes"] <= size and not out.exists()


def test_too_small_memory_says_the_numbers(tmp_path, capsys, monkeypatch):
    import dynaquant.pipeline.analyze as analyze
    monkeypatch.setattr(analyze, "run_analysis", lambda *a, **k: pytest.fail("no analysis may run"))
    kv = 30 * 2 * 192 * 4096 * 2  # the default context, 4096, f16
    out = tmp_path / "o.gguf"
    for memory in (600 * MIB, 690_000_000):  # nothing left for the file; less left than the smallest plan
        margin = 2**29 + memory * 4 // 100
        # (every tensor fixed by a rule: the smallest plan needs no error estimates of the free tensors' formats)
        rc, _, err = _main(capsys, "quantize", "--fit-memory", memory, "-o", out, "--no-eval", "--rule", ".*=Q4_0")
        assert rc == 2 and "--fit-memory" in err and str(kv) in err and str(margin) in err, err
        assert f"leaving {memory - kv - margin} bytes" in err, err
        least = int(re.search(r"smallest plan's (\d+) bytes", err).group(1))
        assert least > max(memory - kv - margin, 0)
        assert f"at least {kv + margin + least} bytes" in err
        assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,message", [
    (["--kv-type", "q8_0"], "--fit-ctx, --kv-type and --margin go with --fit-memory"),
    (["--fit-memory", "8GiB", "--format", "safetensors"], "fit_memory sizes a GGUF file"),
    (["--fit-memory", "8GiB", "--size", "1GB"], "not allowed with argument"),  # argparse's exclusive group
])
def test_bad_fit_options(capsys, argv, message):
    from dynaquant.cli import main

    try:
        rc = main(["quantize", *argv, "--no-eval"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


def test_cli_passes_the_fit_options_and_prints_the_fit(capsys, monkeypatch):
    import dynaquant.pipeline.quantize as quantize

    seen = []
    fit = memory_fit(KVShape((3,) * 30, 64, 64), 8 * GIB, 8192, "q8_0", margin_bytes=0)
    plan = Plan("gguf", "m", [PlanEntry("blk.0.ffn_down.weight", None, (4, 32), "Q8_0", "Q8_0", "rule")])

    def fake(model, cfg):
        seen.append((cfg.fit_memory, cfg.fit_ctx, cfg.kv_type, cfg.margin, cfg.n_ctx, cfg.size))
        return quantize.QuantizeResult("o.gguf", plan, 1000, 8.5, 1.0, fit=fit)

    monkeypatch.setattr(quantize, "run_quantize", fake)
    rc, out, err = _main(capsys, "quantize", "--fit-memory", "8GiB", "--fit-ctx", "8192", "--kv-type", "q8_0",
                         "--margin", "0", "--no-eval")
    assert rc == 0, err
    assert seen == [(8 * GIB, 8192, "q8_0", 0, 512, None)]  # --ctx (calibration) untouched; size set by the run
    assert "fits 8.00 GiB = file <= " in out and "KV cache 0.093 GiB (q8_0, 8192 tokens; 30 layers x 3 KV heads" in out
    rc, out, _ = _main(capsys, "quantize", "--fit-memory", "8GiB", "--no-eval", "--json")
    assert rc == 0 and json.loads(out)["fit"] == fit.to_dict()
    assert seen[-1] == (8 * GIB, 4096, "f16", None, 512, None)  # the defaults: 4096 tokens, f16, default margin


# -- the records ---------------------------------------------------------------------------------------------------


def test_plan_and_result_carry_fit_only_when_set():
    from dynaquant.pipeline.quantize import QuantizeResult

    plan = Plan("gguf", "m", [PlanEntry("blk.0.ffn_down.weight", None, (4, 32), "Q8_0", "Q8_0", "rule")])
    d = plan.to_dict()
    assert "fit" not in d and Plan.from_dict(d).to_dict() == d  # plans without a fit are as before
    assert "fit" not in QuantizeResult("o.gguf", plan, 1, 8.5, 0.0).to_dict()
    fit = memory_fit(KVShape((3,) * 30, 64, 64), 24 * GIB, 8192)
    plan.fit = fit
    d = plan.to_dict()
    assert d["fit"]["kv_bytes"] == SMOL_F16_8192 and Plan.from_dict(d).fit == fit
    assert QuantizeResult("o.gguf", plan, 1, 8.5, 0.0, fit=fit).to_dict()["fit"] == fit.to_dict()
    with pytest.raises(PlanError, match=r"p\.json: fit\.kv_bytes must be an integer"):
        Plan.from_dict({**d, "fit": {**d["fit"], "kv_bytes": "big"}}, "p.json")
