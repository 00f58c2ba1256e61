"""MoE experts kept as the checkpoint stores them (issue 15: a DeepSeek-V3 block within 40 GB of GPU memory): a packed
block's statistics and logits are bit for bit the unpacked block's, its bytes are the stored ones, and
``ModelSkeleton.fit`` packs only when the block does not fit otherwise.

Oracle: the same block-wise pass with the experts materialized in float32 (itself tested against the whole-model pass in
``test_blockwise.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_blockwise import _differences
from test_moe_gguf import _rewrite_checkpoint, _tiny_moe

from dynaquant.analysis.blockwise import collect_blockwise, stream_logits
from dynaquant.analysis.stats import Collect
from dynaquant.errors import InputError
from dynaquant.sources import experts as xp
from dynaquant.sources.checkpoint import resolve_source
from dynaquant.sources.open import open_hf_source
from dynaquant.sources.skeleton import OUTER, build_skeleton


def _stored_experts(folder, case: str):
    """A tiny MoE checkpoint whose per-expert weights are stored as a release stores them: DeepSeek-V3 in FP8 with
    128 x 128 block scales, Qwen2-MoE in BF16 (the rest stays F32)."""
    from safetensors import safe_open

    _tiny_moe(folder, case)
    with safe_open(folder / "model.safetensors", "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k and k.endswith(".weight")}  # noqa: SIM118
    assert disk
    out, qc = {}, {}
    for name, w in disk.items():
        if case == "deepseek-v3":
            n, k = w.shape
            scale = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[name], out[name + "_scale_inv"] = (w / full).to(torch.float8_e4m3fn), scale
            qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        else:
            out[name] = w.to(torch.bfloat16)
    _rewrite_checkpoint(folder, out, set(), qc)
    return resolve_source(str(folder)), open_hf_source(folder)


@pytest.fixture(scope="module", params=["deepseek-v3", "qwen2moe"])
def stored(request, tmp_path_factory):
    return request.param, *_stored_experts(tmp_path_factory.mktemp(request.param), request.param)


def _moe_block(sk) -> int:
    return next(b for b in range(sk.n_blocks) if any(n.startswith(f"model.layers.{b}.mlp.experts") for n in
                                                      sk.parameters_of(b)))


def test_packed_experts_hold_the_stored_bytes_and_decode_to_the_read_values(stored):
    case, source, ts = stored
    sk = build_skeleton(source, ts)
    b = _moe_block(sk)
    itemsize = 1 if case == "deepseek-v3" else 2
    experts = [t for t in ts.tensors() if xp.stacked_name(t.hf_name) and sk.part_of(t.gguf_name) == b]
    assert len(experts) == 3
    for t in experts:
        assert ts.stored_bytes(t) >= t.numel * itemsize and ts.stored_bytes(t) < 2 * t.numel * itemsize
    saved = sum(4 * t.numel - ts.stored_bytes(t) for t in experts)
    assert sk.part_bytes(b, packed=False) - sk.part_bytes(b, packed=True) == saved
    sk.pack_experts = True
    sk.materialize(b)
    mod = sk.model.get_submodule(xp.stacked_name(experts[0].hf_name)[0])
    assert mod.gate_up_proj.is_meta and isinstance(mod.forward, xp.PackedForward)
    for t in experts:
        proj = xp.stacked_name(t.hf_name)[1]
        st = xp.packed(mod)[proj]
        assert st.values.element_size() == itemsize and (st.scale is not None) == (case == "deepseek-v3")
        ref = ts.read(t)
        for e in range(t.shape[0]):
            assert torch.equal(xp.expert_matrix(mod, proj, e), ref[e])
    sk.release(b)
    assert xp.packed(mod) is None and "forward" not in mod.__dict__


def test_packed_blockwise_statistics_and_logits_equal_unpacked(stored):
    """Calibration statistics (H, routing, per-expert Fisher, imatrix) and the block-wise logits: bit for bit."""
    case, source, ts = stored
    chunks = torch.randint(3, 320, (4, 19), generator=torch.Generator().manual_seed(2))
    what = Collect(fisher_sequences=2, imatrix=True)
    results = []
    for pack in (False, True):
        sk = build_skeleton(source, ts)
        sk.pack_experts = pack
        st = collect_blockwise(sk, chunks, what, progress=False)
        logits: list[torch.Tensor] = []
        stream_logits(sk, chunks, 1, lambda v, part, m: None, lambda s, v, x, out=logits: out.append(x.clone()))
        results.append((st, logits))
        assert sk.live == {OUTER}
    (ref, ref_logits), (got, got_logits) = results
    assert _differences(ref, got) == []
    assert got.experts
    assert all(torch.equal(a, b) for a, b in zip(ref_logits, got_logits))


def test_fit_packs_only_a_block_that_does_not_fit(stored):
    case, source, ts = stored
    sk = build_skeleton(source, ts)
    outer = sk.part_bytes(OUTER)
    full = max(sk.part_bytes(b, packed=False) for b in range(sk.n_blocks))
    packed = max(sk.part_bytes(b, packed=True) + sk.check_bytes(b) for b in range(sk.n_blocks))
    assert packed < full and max(sk.check_bytes(b) for b in range(sk.n_blocks)) > 0 == sk.check_bytes(OUTER)
    sk.fit(outer + full)
    assert not sk.pack_experts
    sk.fit(outer + full - 1)
    assert sk.pack_experts
    sk.fit(outer + packed)
    assert sk.pack_experts
    with pytest.raises(InputError, match="do not fit --max-gpu-memory"):
        sk.fit(outer + packed - 1)


def test_packed_analysis_report_equals_unpacked(stored, tmp_path, monkeypatch):
    """The block-wise analysis with the experts packed (as ``--max-gpu-memory`` makes it on a GPU) writes the same
    report, errors of every expert included, bit for bit."""
    import dynaquant
    import dynaquant.pipeline.analyze_blocks as ab
    from dynaquant.analysis.calibration import CalibrationSpec

    case, source, ts = stored
    kw = dict(calibration=CalibrationSpec((), 4, 32), candidates=("Q4_0", "Q8_0"), fisher_sequences=2, progress=False,
              stream=True)
    ref = dynaquant.analyze(source.path, tmp_path / "a", **kw).report
    real = ab.build_skeleton

    def packing(*a, **k):
        sk = real(*a, **k)
        sk.pack_experts = True
        return sk
    monkeypatch.setattr(ab, "build_skeleton", packing)
    got = dynaquant.analyze(source.path, tmp_path / "b", **kw).report
    experts = [e for e in got["tensors"] if "_exps" in e["name"] and e.get("errors")]
    assert experts
    for key in ("calibration", "activations", "experts", "super_weights", "tensors"):
        assert got[key] == ref[key], key


def test_grouped_expert_encoding_writes_the_same_bytes(stored, tmp_path, monkeypatch):
    """``quantize --stream``'s tensor loop reads and encodes a large stacked expert tensor a group of experts at a
    time (``EXPERT_GROUP_BYTES``): the file is byte-identical to encoding each tensor whole, unrouted experts
    included (the imatrix's per-expert rows, imatrix mean filled over all experts)."""
    import dynaquant
    import dynaquant.pipeline.targets as tg
    from dynaquant.pipeline.targets import GGUFTarget

    case, source, ts = stored
    kw = dict(bpw=6.5, calibration_chunks=3, n_ctx=24, evaluate=False, device="cpu", progress=False, stream=True,
              correct_rounds=0)
    dynaquant.quantize(source.path, output=tmp_path / "a.gguf", **kw)
    calls = []
    real = GGUFTarget._encode_groups

    def spy(self, t):
        calls.append(t.gguf_name)
        return real(self, t)
    monkeypatch.setattr(tg, "EXPERT_GROUP_BYTES", 1)
    monkeypatch.setattr(GGUFTarget, "_encode_groups", spy)
    dynaquant.quantize(source.path, output=tmp_path / "b.gguf", **kw)
    assert sorted(calls) == sorted(t.gguf_name for t in ts.tensors() if xp.stacked_name(t.hf_name))
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


def test_read_to_equals_read(stored):
    """``read_to`` (the stored bytes moved, then decoded: what a block's materialization on a GPU uses) gives
    ``read``'s float32 values bit for bit: FP8 with block scales, BF16, F32, q/k permuted or not."""
    _, _, ts = stored
    for t in ts.tensors():
        assert torch.equal(ts.read_to(t, "cpu"), ts.read(t)), t.gguf_name


def test_packed_backward_keeps_no_decoded_weight(stored):
    """The Fisher backward through a packed expert re-decodes its weight instead of keeping it (a DeepSeek-V3 block's
    decoded experts would be 45 GB), with autograd's own gradient."""
    case, source, ts = stored
    sk = build_skeleton(source, ts)
    b = _moe_block(sk)
    sk.pack_experts = True
    sk.materialize(b)
    name, mod = next((n, m) for n, m in xp.find_experts(sk.model).items() if xp.packed(m) is not None)
    hidden = mod.gate_up_proj.shape[-1]
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = xp.expert_linear(mod, 1, "gate_up", x)
    assert tuple(mod.gate_up_proj.shape[1:]) not in saved
    y.square().sum().backward()
    w = torch.cat([xp.expert_matrix(mod, "gate_proj", 1), xp.expert_matrix(mod, "up_proj", 1)])
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, w).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    sk.release(b)


def test_dispatch_calls_each_expert_on_the_eager_loops_rows():
    """``dispatch`` (one sort for all experts) hands each expert the rows transformers' eager loop gives it
    (``torch.where((idx == e).T)``: by choice position, then token), skips masked choices (outside 0..E-1), and sums
    the same result bit for bit."""
    from dynaquant.sources.experts import dispatch

    g = torch.Generator().manual_seed(0)
    for t, k, n in [(37, 4, 16), (300, 8, 64), (5, 2, 3)]:
        x, w = torch.randn(t, 24, generator=g), torch.rand(t, k, generator=g)
        idx = torch.randint(-1, n + 1, (t, k), generator=g)
        weights = torch.randn(n, 24, 24, generator=g)
        calls = []

        def fn(e, xs, ws, calls=calls, weights=weights):
            calls.append((e, xs, ws))
            return xs @ weights[e]
        got = dispatch(x, idx, w, n, fn)
        want, ref = torch.zeros_like(x), []
        for e in torch.unique(idx).tolist():
            if 0 <= e < n:
                pos, tok = torch.where((idx == e).T)
                ref.append((e, x[tok], w[tok, pos]))
                want.index_add_(0, tok, (x[tok] @ weights[e]) * w[tok, pos, None])
        assert torch.equal(got, want) and [c[0] for c in calls] == [r[0] for r in ref]
        assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(calls, ref, strict=True))
