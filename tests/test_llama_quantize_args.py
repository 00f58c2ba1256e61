"""Plans as llama-quantize arguments (``dynaquant plan ... --llama-quantize``): llama.cpp's own tool, given them and a
BF16 GGUF of the default model, writes every tensor in the type our file has.

The mixed plan is cheap to encode on a CPU (most tensors BF16, one or a few in each other format, the 256-block ones
on ``ffn_down``, the only rows of 1536) yet covers what the arguments express: a quantized base type for unnamed
tensors (Q4_0), patterns for a kind in every block (``[0-9]+``), for some blocks, and for kinds merged
(``(attn_k|attn_v)``), the token-embedding option, imatrix-only formats (IQ2_XS, IQ1_S) with the llama-imatrix fixture,
K-quants, i-quants, legacy types, MXFP4, NVFP4, F16 and F32.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import gguf
import pytest

from dynaquant.exporters.gguf.llama_quantize import LlamaQuantizeArgs, llama_quantize_args, simulate, tensor_type_patterns
from dynaquant.quant.plan import Plan

IMATRIX = Path(__file__).parent / "data" / "imatrix_smollm2.gguf"

# tensor -> format over a BF16 plan of the default model (norms F32)
MIXED = {
    "token_embd.weight": "F16",
    **{f"blk.{i}.{k}.weight": "Q4_0" for i in range(10) for k in ("attn_k", "attn_v")},  # the base: most weights
    **{f"blk.{i}.{k}.weight": "Q4_1" for i in (10, 11) for k in ("attn_k", "attn_v")},
    "blk.5.ffn_down.weight": "IQ2_XS", "blk.6.ffn_down.weight": "IQ1_S", "blk.7.ffn_down.weight": "Q5_K",
    "blk.8.ffn_down.weight": "IQ4_XS", "blk.9.ffn_down.weight": "MXFP4", "blk.10.ffn_down.weight": "NVFP4",
    "blk.12.attn_k.weight": "Q5_1", "blk.12.attn_v.weight": "IQ4_NL", "blk.13.attn_q.weight": "Q5_0",
    "blk.0.attn_q.weight": "F16", "blk.14.attn_output.weight": "F32",
}


def _main(capsys, *argv) -> tuple[int, str, str]:
    from dynaquant.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def mixed_plan() -> Plan:
    """The default model's BF16 preset plan with MIXED applied and the imatrix fixture named (no data read)."""
    from dynaquant.pipeline.source import model_info, open_tensor_source, tensor_infos
    from dynaquant.quant.planner import make_plan
    from dynaquant.sources.checkpoint import resolve_source

    ts = open_tensor_source(resolve_source(None))
    plan = make_plan(tensor_infos(ts), model_info(ts), preset="BF16")
    assert set(MIXED) <= set(plan.formats())
    d = plan.to_dict()
    for t in d["tensors"]:
        if t["name"] in MIXED:
            t["format"] = t["requested"] = MIXED[t["name"]]
            t["reason"] = "test"
    d["sources"] = {"imatrix": str(IMATRIX.resolve())}
    return Plan.from_dict(d, "mixed plan")


def _matched(pattern: str, names) -> set[str]:
    """What llama-quantize's ``std::regex_search`` of the lower-cased pattern selects (the ECMAScript subset we write
    means the same in Python's ``re``)."""
    rx = re.compile(pattern.lower())
    return {n for n in names if rx.search(n)}


def test_patterns_select_exactly_the_intended_tensors(mixed_plan):
    args = llama_quantize_args(mixed_plan)
    names = list(mixed_plan.formats())
    assert args.base_type == "Q4_0" and args.token_embedding_type == "f16" and args.output_tensor_type is None
    assert args.imatrix == str(IMATRIX.resolve())
    pats = dict(args.tensor_types)
    assert len(pats) == len(args.tensor_types)  # one type per pattern
    assert pats[r"^blk\.(10|11)\.(attn_k|attn_v)\.weight$"] == "q4_1"  # kinds merged, blocks listed
    assert pats[r"^blk\.[0-9]+\.(ffn_gate|ffn_up)\.weight$"] == "bf16"  # every block
    assert pats[r"^blk\.(?!14\.)[0-9]+\.attn_output\.weight$"] == "bf16"  # all blocks but one
    assert pats[r"^blk\.5\.ffn_down\.weight$"] == "iq2_xs"
    seen: set[str] = set()
    for p, typ in args.tensor_types:
        hit = _matched(p, names)
        assert hit and not hit & seen, p  # disjoint: the order of the options does not matter
        assert {mixed_plan.formats()[n].lower() for n in hit} == {typ}, p
        seen |= hit
    # named: exactly the tensors llama-quantize quantizes whose format is not the base's (token_embd has its option)
    assert seen == {n for n, f in mixed_plan.formats().items() if f not in ("Q4_0", "F32") and n != "token_embd.weight"} \
        | {"blk.14.attn_output.weight"}
    assert simulate(args, {e.name: e.shape for e in mixed_plan.entries}) == mixed_plan.formats()
    assert len(args.tensor_types) < 30  # compact: 30 blocks x 7 kinds are 210 tensors


def test_patterns_of_a_preset_plan_and_edge_cases():
    """A K-quant base with fallbacks (rows of 576), tensors outside the blocks, several towers' block prefixes."""
    wanted = {"blk.0.attn_q.weight": "q8_0", "blk.2.attn_q.weight": "q8_0", "v.blk.0.attn_q.weight": "q6_k",
              "rope_freqs.weight": "f32", "blk.1.ffn_down_exps.weight": "q8_0"}
    names = [*wanted, "blk.1.attn_q.weight", "v.blk.1.attn_q.weight", "blk.0.ffn_down_exps.weight"]
    got = tensor_type_patterns(wanted, names)
    assert got == [(r"^blk\.(0|2)\.attn_q\.weight$", "q8_0"), (r"^v\.blk\.0\.attn_q\.weight$", "q6_k"),
                   (r"^rope_freqs\.weight$", "f32"), (r"^blk\.1\.ffn_down_exps\.weight$", "q8_0")]
    for p, _ in got:
        assert _matched(p, names) <= set(wanted)
    assert _matched(got[0][0], names) == {"blk.0.attn_q.weight", "blk.2.attn_q.weight"}  # not blk.1, not v.blk.0


def _plan(entries, **kw) -> Plan:
    return Plan.from_dict({"target": "gguf", "tensors": [{"name": n, "format": f, "shape": s} for n, f, s in entries],
                           **kw}, "p.json")


def test_what_cannot_be_expressed_is_refused():
    ffn = ("blk.0.ffn_down.weight", "IQ2_XXS", [256, 512])
    with pytest.raises(ValueError, match=r"p\.json: 1 tensor\(s\) .*imatrix .*blk\.0\.ffn_down\.weight \(IQ2_XXS\)"):
        llama_quantize_args(_plan([ffn]), source="p.json")
    assert llama_quantize_args(_plan([ffn]), imatrix="im.gguf").imatrix == "im.gguf"
    with pytest.raises(ValueError, match=r"never quantizes blk\.0\.ffn_gate_inp\.weight \(Q8_0\)"):
        llama_quantize_args(_plan([("blk.0.ffn_gate_inp.weight", "Q8_0", [8, 256])]))
    with pytest.raises(ValueError, match="llama-quantize writes GGUF files only"):
        llama_quantize_args(Plan.from_dict({"target": "safetensors", "tensors": [
            {"name": "blk.0.ffn_down.weight", "format": "INT4_G32", "shape": [256, 512]}]}))
    with pytest.raises(ValueError, match="upper-case"):
        llama_quantize_args(_plan([("blk.0.FFN_down.weight", "Q8_0", [256, 512])]))
    # NVFP4 has no llama-quantize file type: never the base, always named
    a = llama_quantize_args(_plan([("blk.0.ffn_down.weight", "NVFP4", [256, 512]), ("output_norm.weight", "F32", [256])]))
    assert a.base_type == "Q8_0" and a.tensor_types == ((r"^blk\.[0-9]+\.ffn_down\.weight$", "nvfp4"),)
    # all one float type: that file type, nothing named (llama-quantize ignores overrides under a float base)
    a = llama_quantize_args(_plan([("token_embd.weight", "F16", [64, 256]), ("blk.0.ffn_down.weight", "F16", [256, 512])]))
    assert (a.base_type, a.tensor_types, a.token_embedding_type) == ("F16", (), "f16")
    # per_layer_token_embd follows --token-embedding-type unless a pattern names it: always named
    a = llama_quantize_args(_plan([("token_embd.weight", "Q8_0", [64, 256]), ("per_layer_token_embd.weight", "F16", [64, 256]),
                                   ("blk.0.ffn_down.weight", "F16", [256, 512])]))
    assert a.base_type == "Q8_0" and (r"^per_layer_token_embd\.weight$", "f16") in a.tensor_types


def test_command_is_shell_quoted_one_option_a_line():
    a = LlamaQuantizeArgs("Q4_K_M", ((r"^blk\.(0|3)\.attn_q\.weight$", "q6_k"),), "q8_0", "q6_k", "my imatrix.gguf")
    assert a.command("in.gguf", "out.gguf") == (
        "llama-quantize \\\n  --pure \\\n  --imatrix 'my imatrix.gguf' \\\n  --token-embedding-type q8_0 \\\n"
        "  --output-tensor-type q6_k \\\n  --tensor-type '^blk\\.(0|3)\\.attn_q\\.weight$=q6_k' \\\n"
        "  in.gguf out.gguf Q4_K_M")
    assert a.argv("in.gguf", "out.gguf")[-3:] == ["in.gguf", "out.gguf", "Q4_K_M"]


def _report() -> dict:
    """A small valid report: blocks 0-2 of ffn_down (rows of 512) measured in Q4_0 / Q8_0, block 1 the sensitive
    one, and a norm."""
    def errs(kld4):
        return {"Q4_0": {"size_bytes": 73728, "bpw": 4.5, "weighted_rel": 0.006, "output_rel": 0.08, "kld_pred": kld4},
                "Q8_0": {"size_bytes": 139264, "bpw": 8.5, "weighted_rel": 2e-5, "output_rel": 0.004, "kld_pred": 3e-4}}
    t = [{"name": f"blk.{i}.ffn_down.weight", "hf_name": f"model.layers.{i}.mlp.down_proj.weight", "shape": [256, 512],
          "quantizable": True, "errors": errs(0.5 if i == 1 else 0.01)} for i in range(3)]
    t.append({"name": "output_norm.weight", "hf_name": "model.norm.weight", "shape": [256], "quantizable": False,
              "errors": {}})
    return {"version": 1, "model": {"id": "tiny", "n_layers": 3, "gguf_overhead_bytes": 4096},
            "candidates": ["Q4_0", "Q8_0"], "tensors": t, "imatrix": "imatrix.gguf"}


def test_cli_plan_prints_llama_quantize_arguments(tmp_path, capsys):
    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(_report()))
    plan_path = tmp_path / "plan.json"
    rc, out, err = _main(capsys, "plan", rep, "--bpw", "6", "--no-default-rules", "-o", plan_path, "--llama-quantize")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"wrote {plan_path}: ") and lines[1].startswith(f"# {plan_path} with llama.cpp")
    assert lines[2:] == ["llama-quantize \\", "  --pure \\", f"  --imatrix {tmp_path / 'imatrix.gguf'} \\",
                         "  --tensor-type '^blk\\.1\\.ffn_down\\.weight$=q8_0' \\", "  MODEL-BF16.gguf OUTPUT.gguf Q4_0"]
    assert json.loads(plan_path.read_text())["tensors"][1]["format"] == "Q8_0"
    # a plan.json directly (no budget), as JSON
    rc, out, err = _main(capsys, "plan", plan_path, "--llama-quantize", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["base_type"] == "Q4_0" and d["tensor_types"] == [["^blk\\.1\\.ffn_down\\.weight$", "q8_0"]]
    assert d["argv"][:2] == ["llama-quantize", "--pure"] and d["argv"][-3:] == ["MODEL-BF16.gguf", "OUTPUT.gguf", "Q4_0"]
    # no budget and no --llama-quantize: argparse's usage error (exit 2), as before
    with pytest.raises(SystemExit) as e:
        _main(capsys, "plan", rep)
    assert e.value.code == 2 and "one of the arguments --bpw --size is required" in capsys.readouterr().err
    # what cannot be expressed: exit 2, naming the plan
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"target": "gguf", "tensors": [
        {"name": "blk.0.ffn_down.weight", "format": "IQ1_S", "shape": [256, 512]}]}))
    rc, out, err = _main(capsys, "plan", bad, "--llama-quantize")
    assert rc == 2 and f"{bad}: 1 tensor(s) are in formats llama-quantize writes only with an imatrix" in err, err


def test_llama_quantize_reproduces_our_tensor_types(mixed_plan, tmp_path_factory):
    """llama-quantize with the printed arguments on a BF16 GGUF of the default model: every tensor's type equals the
    one in our file written with the same plan (gguf.GGUFReader, tensor by tensor)."""
    from test_gguf_export import _llama_quantize

    import dynaquant

    exe = _llama_quantize()
    d = tmp_path_factory.mktemp("llama_quantize")
    bf16 = dynaquant.quantize(None, preset="BF16", use_imatrix=False, output=d / "bf16.gguf", progress=False).output
    ours = dynaquant.quantize(None, plan=mixed_plan, imatrix=IMATRIX, output=d / "ours.gguf", progress=False).output
    args = llama_quantize_args(mixed_plan)
    r = subprocess.run(args.argv(str(bf16), str(d / "theirs.gguf"), exe) + ["2"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "manual override" in r.stderr + r.stdout and "fallback" not in r.stderr + r.stdout

    def types(p):
        return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(p)).tensors}

    theirs = types(d / "theirs.gguf")
    assert theirs == types(ours) == mixed_plan.formats()
    assert {"IQ2_XS", "IQ1_S", "Q5_K", "IQ4_XS", "MXFP4", "NVFP4", "Q4_0", "Q4_1", "Q5_1", "F16", "BF16"} <= set(theirs.values())
