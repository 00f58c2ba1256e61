"""The block-by-block calibration pass gives, bit for bit, the whole-model pass's statistics, with one decoder
block's weights in memory at a time; the meta-device skeleton holds exactly the checkpoint's weights.

Oracle: :func:`dynaquant.analysis.stats.collect` on the model transformers loads whole (``from_pretrained``; dynaquant's
``load_model`` fills a folder's model from the skeleton's reader, checked against ``from_pretrained`` here too).
"""

from __future__ import annotations

import time

import pytest
import torch
from model_equality import assert_same_model
from test_gguf_export import _tiny_checkpoint
from test_moe_gguf import _tiny_moe

from dynaquant.analysis.blockwise import collect_blockwise, hidden_bytes
from dynaquant.analysis.stats import Collect, collect
from dynaquant.sources.checkpoint import from_pretrained, resolve_source
from dynaquant.sources.model import load_model
from dynaquant.sources.open import open_hf_source
from dynaquant.sources.skeleton import OUTER, build_skeleton

CASES = ["llama", "qwen2", "qwen2moe", "deepseek-v3", "gpt-oss"]  # dense (tied, q/k permuted, biases), MoE, MLA


def transformers_load(source):
    """The checkpoint as transformers' ``from_pretrained`` loads it (float32, CPU, eval; mixture-of-experts layers
    with transformers' eager loop over experts, as dynaquant builds its models, where the release has a choice):
    the oracle."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    kw = {"experts_implementation": "eager"} if hasattr(PretrainedConfig(), "_experts_implementation") else {}
    return from_pretrained(AutoModelForCausalLM, source.folder, trust_remote_code=False, dtype=torch.float32,
                           **kw).eval()


def _checkpoint(folder, case):
    if case in ("llama", "qwen2"):
        _tiny_checkpoint(folder, case)
    else:
        _tiny_moe(folder, case)
    return resolve_source(str(folder)), open_hf_source(folder)


@pytest.fixture(scope="module", params=CASES)
def ckpt(request, tmp_path_factory):
    return request.param, *_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def every_row(monkeypatch):
    """Every row of every tensor measured (the whole-model analysis samples rows by predicted KLD, the block-wise one
    by output energy: with all rows both measure the same)."""
    import dynaquant.analysis.experts as moe_mod
    import dynaquant.pipeline.analyze as an_mod
    import dynaquant.pipeline.analyze_blocks as ab_mod
    from dynaquant.analysis.errors import sample_tensor

    def all_rows(w, rw, **kw):
        return sample_tensor(w, rw, **{**kw, "rows": w.shape[0]})
    for mod in (an_mod, ab_mod, moe_mod):
        monkeypatch.setattr(mod, "sample_tensor", all_rows)


@pytest.fixture
def cheap_formats(monkeypatch):
    """Dense models' quantize runs choose among cheap formats (the i-quants' CPU encoders are slow; the equalities
    hold for any formats)."""
    from dynaquant.pipeline.targets import GGUFTarget

    monkeypatch.setattr(GGUFTarget, "analysis_candidates", ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"))


def _equal(a, b, name: str) -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return [] if a is not None and b is not None and torch.equal(a, b) else [name]
    return [] if a == b else [name]


def _differences(a, b) -> list[str]:
    """Names of the statistics that differ between two ModelStats (bit for bit)."""
    out = _equal(a.input_of, b.input_of, "input_of") + _equal(set(a.outputs), set(b.outputs), "outputs")
    for k, s in a.inputs.items():
        for f in ("hessian_sum", "absmax", "tokens", "sq_sum", "qerr_sum", "modules"):
            out += _equal(getattr(s, f), getattr(b.inputs[k], f), f"{k}.{f}")
    for k, o in a.outputs.items():
        for f in ("absmax", "fisher_tokens"):
            out += _equal(getattr(o, f), getattr(b.outputs[k], f), f"{k}.{f}")
        if o.fisher_sum is not None or b.outputs[k].fisher_sum is not None:
            out += _equal(o.fisher_sum, b.outputs[k].fisher_sum, f"{k}.fisher_sum")
    for f in ("embed_fisher_sum", "token_counts", "sequences", "tokens", "fisher_sequences", "fisher_tokens"):
        out += _equal(getattr(a, f), getattr(b, f), f)
    out += _equal(set(a.experts), set(b.experts), "experts")
    for k, e in a.experts.items():
        for f in ("tokens", "weight_sum", "fisher_tokens"):
            out += _equal(getattr(e, f), getattr(b.experts[k], f), f"{k}.{f}")
        for d in ("hessian_sum", "fisher_sum"):
            da, db = getattr(e, d), getattr(b.experts[k], d)
            out += _equal(set(da), set(db), f"{k}.{d}") + [x for kk in da for x in _equal(da[kk], db.get(kk), f"{k}.{d}.{kk}")]
    for k, v in a.imatrix.sums.items():
        out += _equal(v, b.imatrix.sums.get(k), f"imatrix {k}") + _equal(a.imatrix.counts[k], b.imatrix.counts[k], k)
    return out


def test_skeleton_materializes_the_checkpoint(ckpt):
    """Every parameter and buffer of the skeleton, once materialized part by part, equals transformers' own load
    (tied heads stay tied); released parts go back to the meta device."""
    case, source, ts = ckpt
    full = transformers_load(source)
    sk = build_skeleton(source, ts)
    assert all(p.device.type == "meta" for p in sk.model.parameters())
    assert sk.part_bytes(0) == sum(p.numel() * 4 for p in full.model.layers[0].parameters())
    for part in [OUTER, *range(sk.n_blocks)]:
        sk.materialize(part)
    ref, got = dict(full.named_parameters()), dict(sk.model.named_parameters())
    assert ref.keys() == got.keys()
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []
    rb, gb = dict(full.named_buffers()), dict(sk.model.named_buffers())
    assert [n for n in rb if not torch.equal(rb[n], gb[n])] == []
    assert (sk.model.get_output_embeddings().weight is sk.model.get_input_embeddings().weight) == \
        (full.get_output_embeddings().weight is full.get_input_embeddings().weight)
    for b in range(sk.n_blocks):
        sk.release(b)
    assert sk.live == {OUTER}
    assert all(p.device.type == "meta" for p in sk.layers.parameters())


def test_load_model_fills_a_folder_from_its_tensors(ckpt, monkeypatch):
    """``load_model`` of a folder builds the model on the meta device and fills it from dynaquant's reader (no
    ``from_pretrained`` of the model): every parameter, buffer, flag and the logits as transformers' own load."""
    import dynaquant.sources.model as model_mod

    case, source, ts = ckpt
    theirs = transformers_load(source)

    def refuse(cls, *a, **kw):
        raise AssertionError(f"from_pretrained({cls.__name__}) called")
    monkeypatch.setattr(model_mod, "from_pretrained", refuse)
    ours = load_model(source)
    assert_same_model(ours, theirs, torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(2)))


def test_llama_q_k_biases_are_written_in_the_models_row_order(tmp_path):
    """A Llama with attention biases: the reader gives q/k weights AND biases in llama.cpp's row order (as
    convert_hf_to_gguf.py permutes both); the skeleton (and so ``load_model``) puts both back in the model's."""
    _tiny_checkpoint(tmp_path / "ckpt", "llama", attention_bias=True)
    source = resolve_source(str(tmp_path / "ckpt"))
    ours, theirs = dict(load_model(source).named_parameters()), dict(transformers_load(source).named_parameters())
    assert "model.layers.0.self_attn.q_proj.bias" in theirs
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


def test_blockwise_statistics_equal_the_whole_model_pass(ckpt, monkeypatch):
    """H, activation statistics, output maxima, Fisher diagonals (linear outputs, MoE experts, embedding), routing
    and the imatrix: bit for bit those of the whole-model pass, with at most one block materialized at a time."""
    case, source, ts = ckpt
    chunks = torch.randint(3, 320, (5, 23), generator=torch.Generator().manual_seed(1))  # odd length, odd count
    what = Collect(fisher_sequences=2, imatrix=True)
    ref = collect(transformers_load(source), chunks, what, progress=False)
    sk = build_skeleton(source, ts)
    most = []
    real = type(sk).materialize

    def watch(self, part):
        real(self, part)
        most.append(len(self.live - {OUTER}))
    monkeypatch.setattr(type(sk), "materialize", watch)
    got = collect_blockwise(sk, chunks, what, progress=False)
    assert _differences(ref, got) == []
    assert got.fisher_sequences == 2 and got.embed_fisher_sum is not None
    assert (case in ("qwen2moe", "deepseek-v3", "gpt-oss")) == bool(got.experts)
    assert max(most) == 1 and sk.live == {OUTER}  # one block at a time, all released at the end


def test_missing_tensor_is_named(tmp_path, monkeypatch):
    """A source without one of a block's weights: materializing that block names the parameter."""
    source, ts = _checkpoint(tmp_path / "ckpt", "llama")
    listed = ts.tensors()
    monkeypatch.setattr(ts, "tensors", lambda: [t for t in listed if t.gguf_name != "blk.1.ffn_up.weight"])
    sk = build_skeleton(source, ts)
    sk.materialize(0)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        sk.materialize(1)


def test_skeleton_of_a_deepseek_v3_layer_allocates_no_parameter():
    """DeepSeek-V3's real shapes cut to 4 blocks (3 dense, 1 MoE): one MoE layer's stacked experts alone are 45 GB
    in float32, more than this machine's memory. Built on the meta device (transformers >= 5), nothing is allocated
    (an allocation that size fails here), every parameter is meta, and the buffers (RoPE frequencies, the router's
    score-correction bias) equal those of the same modules built normally."""
    import transformers
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from dynaquant.sources.skeleton import _on_meta

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers < 5 builds skeletons with accelerate's init_empty_weights")
    cfg = DeepseekV3Config(num_hidden_layers=4, vocab_size=1024)

    def build(ctx):
        with ctx:
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)

    model = _on_meta(build)
    assert model is not None
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) * 4 > 45e9 and all(p.is_meta for p in params.values())
    buffers = dict(model.named_buffers())
    ref = type(model.model.rotary_emb)(config=cfg)
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], ref.inv_freq)
    assert torch.equal(buffers["model.layers.3.mlp.gate.e_score_correction_bias"], torch.zeros(cfg.n_routed_experts))


def test_hidden_bytes():
    # 8 sequences of 512 tokens, hidden 4096, 32 blocks, 4 Fisher sequences: current states + Fisher inputs + grads
    assert hidden_bytes(8, 512, 4096, 32, 4) == 512 * 4096 * 4 * (8 + 4 * 33)


def test_superweight_ablation_blockwise_equals_whole_model(tmp_path):
    """Super-weight confirmation block by block (original and ablations as variants of one pass) gives the same
    perplexities as ablating the whole model, bit for bit."""
    from dynaquant.analysis.superweights import SuperWeight, confirm, confirm_blockwise

    source, ts = _checkpoint(tmp_path / "ckpt", "llama")
    chunks = torch.randint(3, 320, (2, 19), generator=torch.Generator().manual_seed(4))

    def cands():  # the largest weight of each down_proj, and one of block 0 that barely matters
        full = transformers_load(source)
        out = []
        for i in range(2):
            w = full.get_submodule(f"model.layers.{i}.mlp.down_proj").weight.detach()
            r, c = divmod(int(w.abs().argmax()), w.shape[1])
            out.append(SuperWeight(i, f"model.layers.{i}.mlp.down_proj", r, c, float(w[r, c]), 0.0, 0.0, 99.0))
        out.append(SuperWeight(0, "model.layers.0.mlp.down_proj", 0, 0, 0.0, 0.0, 0.0, 60.0))
        return full, out

    full, want = cands()
    confirm(full, want, chunks)
    got = confirm_blockwise(build_skeleton(source, ts), cands()[1], chunks)
    assert [(s.ppl_base, s.ppl_ablated, s.confirmed) for s in got] == [(s.ppl_base, s.ppl_ablated, s.confirmed) for s in want]
    assert got[0].ppl_ablated != got[0].ppl_base and len({s.ppl_ablated for s in got}) == 3


@pytest.mark.parametrize("case", ["llama", "qwen2moe", "deepseek-v3"])
def test_blockwise_analysis_report_equals_whole_model(case, tmp_path, every_row):
    """``analyze(..., stream=True)`` writes the whole-model analysis's report: same entries, formats, activation
    statistics, routing and imatrix. Every row measured (so that the two row samplings, by predicted KLD and by
    output energy, pick the same rows), the errors agree to rounding (float32 / float64 Fisher weighting)."""
    import dynaquant
    from dynaquant.analysis.calibration import CalibrationSpec
    _checkpoint(tmp_path / "ckpt", case)
    kw = dict(calibration=CalibrationSpec((), 4, 32), candidates=("Q4_0", "Q8_0", "Q4_K"), fisher_sequences=2,
              progress=False)
    whole = dynaquant.analyze(tmp_path / "ckpt", tmp_path / "a", **kw).report
    res = dynaquant.analyze(tmp_path / "ckpt", tmp_path / "b", stream=True, **kw)
    got = res.report
    assert got["calibration"].pop("blockwise") is True
    for key in ("model", "calibration", "candidates", "activations", "experts", "super_weights"):
        assert got[key] == whole[key], key
    assert [e["name"] for e in got["tensors"]] == [e["name"] for e in whole["tensors"]]
    measured = 0
    for g, w in zip(got["tensors"], whole["tensors"]):
        assert {k: v for k, v in g.items() if k != "errors"} == {k: v for k, v in w.items() if k != "errors"}, g["name"]
        assert g["errors"].keys() == w["errors"].keys(), g["name"]
        for f, e in w["errors"].items():
            measured += 1
            assert g["errors"][f]["size_bytes"] == e["size_bytes"]
            for k in ("weighted_rel", "output_rel", "kld_pred"):
                assert g["errors"][f][k] == pytest.approx(e[k], rel=2e-5, abs=1e-12), (g["name"], f, k)
    assert measured > 20
    assert (tmp_path / "b" / "imatrix.gguf").read_bytes() == (tmp_path / "a" / "imatrix.gguf").read_bytes()
    # no (K, K) matrix kept but the output head's (measured last)
    assert [k for k, s in res.stats.inputs.items() if s.hessian_sum is not None] == ["lm_head"]
    assert all(not e.hessian_sum for e in res.stats.experts.values())


@pytest.mark.parametrize("case", ["llama", "qwen2moe"])
def test_quantize_stream_equals_whole_model(case, tmp_path, every_row):
    """``quantize(..., stream=True)``: the block-wise analysis, plan, file and evaluation of the whole-model run (every
    row measured, as above): the same plan and bytes, the same KLD / perplexity / top-1, bit for bit; the block-wise
    evaluation of a file equals the whole-model evaluation of it."""
    import dynaquant
    _checkpoint(tmp_path / "ckpt", case)
    kw = dict(bpw=6.5, calibration_chunks=4, n_ctx=32, evaluate=True, eval_chunks=3, device="cpu", progress=False)
    whole = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "a.gguf", **kw)
    got = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "b.gguf", stream=True, **kw)
    assert got.plan.formats() == whole.plan.formats()
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    assert got.eval.to_dict() == whole.eval.to_dict() and got.eval.kld_mean > 0


def test_stream_refuses_what_needs_the_whole_model(tmp_path):
    import dynaquant

    _checkpoint(tmp_path / "ckpt", "llama")
    # the safetensors target streams now (tests/test_stream_safetensors.py); what it does not do yet is refused
    with pytest.raises(ValueError, match="stream"):
        dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "a", bpw=6.5, target="safetensors", stream=True,
                           gptq=True, progress=False)
    with pytest.raises(ValueError, match="stream"):
        dynaquant.analyze(tmp_path / "ckpt", validate_presets=("Q4_K_M",), stream=True, progress=False)


class _Killed(Exception):
    pass


class _MemoryCheckpoints:
    """Checkpoints kept as torch.save bytes (read back with weights_only=True, as the work folder does); the run is
    "killed" (an exception) right after the ``kill_after``-th save."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.kill_after, self.saves = None, 0

    def save(self, name, state):
        import io

        buf = io.BytesIO()
        torch.save(state, buf)
        self.files[name] = buf.getvalue()
        self.saves += 1
        if self.kill_after is not None and self.saves >= self.kill_after:
            raise _Killed(name)

    def load(self, name, device="cpu"):
        import io

        data = self.files.get(name)
        return None if data is None else torch.load(io.BytesIO(data), map_location=device, weights_only=True)

    def remove(self, name):
        self.files.pop(name, None)


@pytest.mark.parametrize("offload", [False, True])
def test_blockwise_resumes_from_any_checkpoint_bit_for_bit(tmp_path, offload):
    """Killed after any checkpoint (forward sweep, head, backward sweep) and started again, the block-wise pass gives
    the statistics of an uninterrupted one, bit for bit, and hands the caller's own state back; also with the
    hidden states in files (``offload_dir``)."""
    source, ts = _checkpoint(tmp_path / "ckpt", "qwen2moe")
    chunks = torch.randint(3, 320, (4, 17), generator=torch.Generator().manual_seed(5))
    what = Collect(fisher_sequences=2, imatrix=True)
    ref = collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False)
    off = {"offload_dir": tmp_path / "off"} if offload else {}
    assert _differences(ref, collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False, **off)) == []
    whole = _MemoryCheckpoints()
    same = collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False, checkpoints=whole, **off)
    assert _differences(ref, same) == []
    if offload:
        # (the run without checkpoints keeps the Fisher inputs there too; with checkpoints they go with those)
        assert sorted(p.name for p in (tmp_path / "off").iterdir()) == [
            "fisher-in-00000", "fisher-in-00001", "hidden-0", "hidden-1", "hidden-in"]
    n_saves = whole.saves  # forward: 2 blocks (+ 2 Fisher inputs), head, backward: 2 blocks
    assert n_saves == 7

    def run(cp, seen: dict):  # the caller's state: the blocks it was handed
        return collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False, checkpoints=cp, **off,
                                 on_block=lambda i, st: seen["blocks"].append(i), extra=(lambda: dict(seen), seen.update))

    for k in range(1, n_saves):
        cp = _MemoryCheckpoints()
        cp.kill_after = k
        with pytest.raises(_Killed):
            run(cp, {"blocks": []})
        cp.kill_after = None
        resumed = {"blocks": []}
        got = run(cp, resumed)
        assert _differences(ref, got) == [], k
        assert resumed["blocks"] == [0, 1], k  # each block measured once, in one run or the other


def test_blockwise_checkpoints_by_time_resume_bit_for_bit(tmp_path, monkeypatch):
    """``checkpoint_every``: a checkpoint of in-memory hidden states or gradients only once that many seconds have
    passed since the last (the clock here: 1 s a call); the Fisher inputs are written after every block as before.
    Killed after any save, the run continues from the last checkpoint written (or from the start) to the same bits."""
    import dynaquant.analysis.blockwise as bw

    source, ts = _checkpoint(tmp_path / "ckpt", "qwen2moe")
    chunks = torch.randint(3, 320, (4, 17), generator=torch.Generator().manual_seed(5))
    what = Collect(fisher_sequences=2, imatrix=True)
    ref = collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False)

    class Clock:
        t = 0.0

        def monotonic(self):
            self.t += 1.0
            return self.t
    monkeypatch.setattr(bw, "time", type("T", (), {"monotonic": Clock().monotonic, "perf_counter": time.perf_counter}))

    def run(cp, every, seen):
        return collect_blockwise(build_skeleton(source, ts), chunks, what, progress=False, checkpoints=cp,
                                 checkpoint_every=every, on_block=lambda i, st: seen.append(i))

    never = _MemoryCheckpoints()
    assert _differences(ref, run(never, 1e9, [])) == []
    assert sorted(never.files) == ["analysis/fisher-in-00000.pt", "analysis/fisher-in-00001.pt"]  # no stage checkpoint
    some = _MemoryCheckpoints()
    assert _differences(ref, run(some, 3.0, [])) == []
    stages = [n for n in some.files if "fisher-in" not in n]
    assert 0 < len(stages) and some.saves < 7  # fewer than one after every step (7 saves then)
    for k in range(1, some.saves):
        cp = _MemoryCheckpoints()
        cp.kill_after = k
        with pytest.raises(_Killed):
            run(cp, 3.0, [])
        cp.kill_after = None
        assert _differences(ref, run(cp, 3.0, [])) == [], k


def test_checkpoint_interval_comes_from_the_environment(monkeypatch):
    from dynaquant.pipeline.rundir import CHECKPOINT_EVERY_S, checkpoint_interval_s

    monkeypatch.delenv("DYNAQUANT_CHECKPOINT_S", raising=False)
    assert checkpoint_interval_s() == CHECKPOINT_EVERY_S
    monkeypatch.setenv("DYNAQUANT_CHECKPOINT_S", "0")
    assert checkpoint_interval_s() == 0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("DYNAQUANT_CHECKPOINT_S", bad)
        with pytest.raises(ValueError, match="DYNAQUANT_CHECKPOINT_S"):
            checkpoint_interval_s()


def test_quantize_stream_vision_language_gguf(tmp_path, every_row):
    """A Qwen2-VL folder to GGUF with --stream: the language model analysed block by block (the vision tower, which the
    GGUF's tensor source does not hold, stays on the meta device), the same file and evaluation as the whole-model
    run (every row measured, as above: the two analyses sample rows by different scores), and the mmproj beside it."""
    from test_vl_gguf import _tiny_vl_checkpoint

    import dynaquant

    _tiny_vl_checkpoint(tmp_path / "ckpt")
    kw = dict(bpw=6.5, calibration_chunks=4, n_ctx=32, evaluate=True, eval_chunks=2, device="cpu", progress=False)
    whole = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "a.gguf", **kw)
    got = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "b.gguf", stream=True, **kw)
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    assert got.eval.to_dict() == whole.eval.to_dict()
    assert got.mmproj is not None and got.mmproj.read_bytes() == whole.mmproj.read_bytes()


def test_measured_corrections_blockwise_equal_whole_model(tmp_path, every_row, cheap_formats):
    """``quantize(..., stream=True, correct_rounds=2)``: the plan measured block by block (original, whole plan and
    each group alone as variants of one pass) gives the whole-model measurements, hence the same corrected plan and
    file (every row measured, as above)."""
    import dynaquant
    _tiny_checkpoint(tmp_path / "ckpt", "llama", hidden_size=256, intermediate_size=512)
    kw = dict(bpw=7.0, calibration_chunks=4, n_ctx=32, correct_rounds=2, correct_sequences=2, device="cpu",
              progress=False)
    whole = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "a.gguf", **kw)
    got = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "b.gguf", stream=True, **kw)
    rounds = whole.plan.corrections["rounds"]
    assert rounds and got.plan.corrections["rounds"] == rounds
    assert all(r["kld_measured"] > 0 and r["groups_sum"] > 0 for r in rounds)
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


@pytest.mark.parametrize("case", ["llama", "qwen2moe"])
def test_gptq_blockwise_equals_whole_model(case, tmp_path, every_row):
    """``quantize(..., stream=True, gptq=True)``: GPTQ block by block (H of each block from one more block-wise pass, the
    held-out check's H from two sequences carried along) rounds every tensor as the whole-model run does: same file,
    same per-format summary."""
    import dynaquant
    if case == "llama":
        _tiny_checkpoint(tmp_path / "ckpt", "llama", hidden_size=256, intermediate_size=512)
    else:
        _checkpoint(tmp_path / "ckpt", case)
    kw = dict(bpw=6.0, calibration_chunks=4, n_ctx=32, gptq=True, device="cpu", progress=False)
    whole = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "a.gguf", **kw)
    got = dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / "b.gguf", stream=True, **kw)
    assert whole.gptq and got.gptq == whole.gptq
    assert sum(v["gptq"] for v in got.gptq.values()) > 0  # some tensors took GPTQ
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
