"""dynaquant.kernels.grouped: the routing table and the grouped mixture-of-experts kernel against per-expert products.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

from test_kernels import packed_weight, rel_err  # noqa: E402

import dynaquant.kernels.grouped as grouped  # noqa: E402
from dynaquant.kernels import linear_ref, pack, stack, unpack  # noqa: E402
from dynaquant.kernels.grouped import grouped_linear, grouped_linear_ref, route, route_torch  # noqa: E402


def _stacked(fmt: str, e: int, n: int, k: int, gen: torch.Generator, super_weights=None):
    """E experts' random weights, each packed alone, and the same codes packed as one (E N, K) stacked layout."""
    experts = [packed_weight(fmt, n, k, gen) for _ in range(e)]
    parts = [unpack(p) for p in experts]
    cat = [None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(3)]
    stacked = pack(*cat, fmt, global_scale=experts[0].global_scale if experts[0].fmt.kind == "nvfp4" else None,
                   super_weights=super_weights)
    return experts, stacked


def test_route_blocks_cover_every_slot_once_in_expert_order():
    idx = torch.tensor([[3, 0], [3, 1], [-1, 3], [0, 7], [3, 3]])  # -1 and 7 (E = 4) are skipped choices
    r = route(idx, 4, block_m=16)
    flat = idx.reshape(-1)
    assert torch.equal(r.token, r.order // 2)
    assert torch.equal(r.expert, torch.tensor([0, 0, 1, 3, 3, 3, 3, 3, 4, 4]))
    assert torch.equal(r.order[:8], torch.tensor([1, 6, 3, 0, 2, 5, 8, 9]))  # stable: token order within an expert
    assert torch.equal(flat[r.order[:8]], r.expert[:8])
    covered = torch.zeros(10, dtype=torch.int64)
    for e, a, b in r.blocks():
        covered[a:b] += 1
        assert (r.expert[a:b] == e).all()
    assert covered.tolist() == [1] * 8 + [0, 0]  # skipped choices in no block
    assert r.block_expert.numel() == 1 + 4  # ceil(10 / 16) + min(E, S): the fixed bound
    assert r.blocks() == [(0, 0, 2), (1, 2, 3), (3, 3, 8)]


def test_route_splits_an_expert_longer_than_a_block():
    idx = torch.zeros(40, 1, dtype=torch.int64)
    idx[::3] = 2
    r = route(idx, 3, block_m=16)
    assert r.blocks() == [(0, 0, 16), (0, 16, 26), (2, 26, 40)]
    with pytest.raises(ValueError):
        route(idx, 3, block_m=24)


ROUTING_FIELDS = ("order", "token", "expert", "block_expert", "expert_block", "expert_bounds")


def _routing_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, int, int]]:
    """(top_k_index, E, block_m): fixed corners and random routings (T log-uniform in 1..300, k 1..8, E 4..257,
    about one choice in eight skipped: negative or >= E)."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    cases = [(torch.randint(0, 128, (1, 8), generator=gen), 128, 16),  # Qwen3-30B-A3B, one token
             (torch.full((300, 8), 5), 257, 64),  # every choice to one expert: blocks of one expert only
             (torch.full((7, 3), -1), 6, 16),  # every choice skipped
             (torch.randint(-3, 260, (128, 8), generator=gen), 257, 32),  # ROUTE_MAX_SLOTS, 257 experts
             (torch.randint(-3, 260, (300, 8), generator=gen), 257, 16),  # 2400 slots: route_torch
             (torch.randint(0, 4, (16, 1), generator=gen).to(torch.int32), 4, 16)]  # int32 indices, k = 1
    for _ in range(24):
        t = int(torch.exp(torch.rand((), generator=gen) * torch.log(torch.tensor(300.0)))) or 1
        k, e = draw(1, 8), draw(4, 257)
        idx = torch.randint(0, e, (t, k), generator=gen)
        skip = torch.rand(t, k, generator=gen) < 0.125
        idx[skip] = torch.where(torch.rand(t, k, generator=gen) < 0.5, -1 - idx, e + idx)[skip]
        cases.append((idx, e, (16, 32, 64)[draw(0, 2)]))
    return cases


def test_route_kernel_equals_the_torch_reference_field_by_field(monkeypatch):
    """``route``'s one-launch kernel (Triton: compiled on CUDA, else the interpreter) gives ``route_torch``'s tables
    exactly (dtype, shape, values) on random routings; past ``ROUTE_MAX_SLOTS`` slots ``route`` is ``route_torch``."""
    calls = []

    def spy(*args):
        calls.append(args)
        return route_torch(*args)

    gen = torch.Generator().manual_seed(11)
    monkeypatch.setattr(grouped, "route_torch", spy)  # (route_torch itself kept as the reference)
    cases = _routing_cases(gen)
    for idx, e, bm in cases:
        calls.clear()
        got, want = route(idx.to(DEVICE), e, bm), route_torch(idx.to(DEVICE), e, bm)
        assert len(calls) == (idx.numel() > grouped.ROUTE_MAX_SLOTS)  # the kernel up to its bound
        assert (got.num_experts, got.block_m, got.slots) == (e, bm, idx.numel())
        for f in ROUTING_FIELDS:
            a, b = getattr(got, f), getattr(want, f)
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), (tuple(idx.shape), e, bm, f)
    assert sum(idx.numel() <= grouped.ROUTE_MAX_SLOTS for idx, _, _ in cases) >= 20


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G128", "INT3_G128", "INT4_G64_ASYM", "MXFP4_G32", "NVFP4_G16"])
def test_grouped_linear_equals_each_experts_product(fmt, gemv):
    gen = torch.Generator().manual_seed(7)
    e, n, k, t, top = 4, 48, 128, 9, 2
    experts, stacked = _stacked(fmt, e, n, k, gen)
    x = torch.randn(t, k, generator=gen).to(DEVICE)
    idx = torch.randint(0, e, (t, top), generator=gen)
    idx[2, 1] = -1  # a masked choice
    r = route(idx.to(DEVICE), e)
    want = torch.zeros(r.slots, n, dtype=torch.float64, device=DEVICE)
    for s in range(r.slots):
        ex = int(r.expert[s])
        if ex < e:
            want[s] = linear_ref(x[r.token[s]][None], experts[ex])[0].double()
    ref = grouped_linear_ref(x, stacked, r)
    assert rel_err(ref, want) < 1e-6
    got = grouped_linear(x.to(torch.bfloat16), stacked, r, gemv=gemv).float()
    valid = r.expert < e
    assert rel_err(got[valid], want[valid]) < 1e-2
    ys = grouped_linear(x[r.token].to(torch.bfloat16), stacked, r, sorted_input=True, gemv=gemv).float()
    assert torch.equal(ys[valid], got[valid])
    w = torch.rand(t * top, generator=gen).to(DEVICE).to(torch.bfloat16)  # the epilogue: weighted, in slot order
    scattered = grouped_linear(x.to(torch.bfloat16), stacked, r, slot_weights=w, gemv=gemv).float()
    want_w = torch.zeros_like(want)
    want_w[r.order[valid]] = want[valid] * w[r.order[valid]].double()[:, None]
    assert rel_err(scattered, want_w) < 1e-2 and not scattered[2 * top + 1].any()  # the masked choice: zero
    assert rel_err(grouped_linear(x, stacked, r, slot_weights=w), want_w) < 1e-2  # float32: the torch reference


@pytest.mark.parametrize("fmt,words", [("INT4_G64", 16), ("INT4_G128", 64), ("INT2_G128", 16), ("MXFP4_G32", 64)])
def test_grouped_gemv_half2(fmt, words):
    """The grouped GEMV with the packed-fp16 word products and wide K tiles: each slot's expert product, weighted
    in slot order; formats without that decode refused."""
    gen = torch.Generator().manual_seed(8)
    e, n, k, t, top = 4, 48, 512, 5, 2
    experts, stacked = _stacked(fmt, e, n, k, gen)
    x = torch.randn(t, k, generator=gen).to(DEVICE)
    idx = torch.randint(0, e, (t, top), generator=gen)
    r = route(idx.to(DEVICE), e)
    want = torch.stack([linear_ref(x[r.token[s]][None], experts[int(r.expert[s])])[0].double()
                        for s in range(r.slots)])
    got = grouped_linear(x.to(torch.bfloat16), stacked, r, gemv=True, half2=True, words=words, block_n=16).float()
    assert rel_err(got, want) < 1e-2
    w = torch.rand(t * top, generator=gen).to(DEVICE).to(torch.bfloat16)
    scattered = grouped_linear(x.to(torch.bfloat16), stacked, r, slot_weights=w, gemv=True, half2=True, words=words)
    want_w = torch.zeros_like(want)
    want_w[r.order] = want * w[r.order].double()[:, None]
    assert rel_err(scattered.float(), want_w) < 1e-2
    _, asym = _stacked("INT4_G64_ASYM", e, n, k, gen)
    with pytest.raises(ValueError, match="half2"):
        grouped_linear(x.to(torch.bfloat16), asym, r, gemv=True, half2=True)


@pytest.mark.parametrize("fmt,launch", [("INT4_G128", dict(gemv=True)), ("INT4_G128", dict(gemv=False)),
                                        ("INT2_G128", dict(gemv=True, half2=True, block_n=16)),
                                        ("INT4_G64_ASYM", dict(gemv=False, block_n=32)), ("MXFP4_G32", dict(gemv=True))])
def test_grouped_linear_silu_epilogue_is_silu_of_gate_times_up(fmt, launch):
    """``act="silu"``: each expert's stacked rows gate (first half) then up, the kernel's epilogue writes
    ``silu(gate) * up`` (S, N / 2): the per-expert products' and the unfused launch's torch activation, to bf16
    rounding (the interpreter truncates the unfused launch's stores; compiled, both round to nearest)."""
    gen = torch.Generator().manual_seed(9)
    e, n, k, t, top = 4, 48, 256, 9, 2
    experts, stacked = _stacked(fmt, e, n, k, gen)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16).float().to(DEVICE)  # (the kernel's bf16 input exactly)
    idx = torch.randint(0, e, (t, top), generator=gen)
    idx[4, 0] = e  # a skipped choice
    r = route(idx.to(DEVICE), e)
    valid = r.expert < e
    h = n // 2
    want = torch.zeros(r.slots, h, dtype=torch.float64, device=DEVICE)
    for s in range(r.slots):
        if valid[s]:
            y = linear_ref(x[r.token[s]][None], experts[int(r.expert[s])])[0].double()
            want[s] = torch.nn.functional.silu(y[:h]) * y[h:]
    xb = x.to(torch.bfloat16)
    got = grouped_linear(xb, stacked, r, act="silu", **launch)
    assert got.shape == (r.slots, h) and got.dtype == torch.bfloat16
    assert rel_err(got[valid].float(), want[valid]) < 1e-2
    full = grouped_linear(xb, stacked, r, **launch)
    unfused = torch.nn.functional.silu(full[:, :h]) * full[:, h:]
    assert rel_err(got[valid].float(), unfused[valid].float()) < 1e-2
    swapped = torch.nn.functional.silu(full[:, h:]) * full[:, :h]  # (the other pairing is far off)
    assert rel_err(swapped[valid].float(), want[valid]) > 0.1
    ref = grouped_linear(x, stacked, r, act="silu")  # float32: the torch reference, then the torch activation
    full32 = grouped_linear_ref(x, stacked, r)
    assert torch.equal(ref, torch.nn.functional.silu(full32[:, :h]) * full32[:, h:])
    with pytest.raises(ValueError, match="act"):
        grouped_linear(xb, stacked, r, act="silu", slot_weights=torch.ones(r.slots, device=DEVICE), **launch)
    with pytest.raises(ValueError, match="act"):
        grouped_linear(xb, stacked, r, act="gelu", **launch)


def test_grouped_linear_adds_super_weights_to_their_expert_only():
    gen = torch.Generator().manual_seed(3)
    e, n, k = 3, 32, 128
    sw = (torch.tensor([5, 32 + 7, 64 + 31]), torch.tensor([0, 100, 127]), torch.tensor([0.5, -2.0, 1.25]))
    experts, stacked = _stacked("INT4_G128", e, n, k, gen, super_weights=tuple(t.to(DEVICE) for t in sw))
    x = torch.randn(6, k, generator=gen).to(DEVICE)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 0], [1, 1], [2, 2]], device=DEVICE)
    r = route(idx, e)
    plain = grouped_linear(x.to(torch.bfloat16), pack(*unpack(stacked), "INT4_G128"), r).float()
    got = grouped_linear(x.to(torch.bfloat16), stacked, r).float()
    ref = grouped_linear_ref(x, stacked, r)
    assert rel_err(got, ref) < 1e-2
    w = torch.rand(r.slots, generator=gen).to(DEVICE).to(torch.bfloat16)  # super weights: weighted in torch after
    scattered = grouped_linear(x.to(torch.bfloat16), stacked, r, slot_weights=w).float()
    assert torch.allclose(scattered[r.order], got * w[r.order].float()[:, None], atol=1e-2, rtol=1e-2)
    fused = grouped_linear(x.to(torch.bfloat16), stacked, r, act="silu", gemv=True)  # super weights: act in torch
    sup = grouped_linear(x.to(torch.bfloat16), stacked, r, gemv=True)
    assert torch.equal(fused, torch.nn.functional.silu(sup[:, :n // 2]) * sup[:, n // 2:])
    d = got - plain
    deltas = stacked.super_weights[2].tolist()  # value - decoded weight, each in its expert's rows
    for s in range(r.slots):
        ex = int(r.expert[s])
        row, col, delta = [5, 7, 31][ex], [0, 100, 127][ex], deltas[ex]
        expect = torch.zeros(n)
        expect[row] = float(x[r.token[s], col].to(torch.bfloat16)) * delta
        assert torch.allclose(d[s].cpu(), expect, atol=2e-2)


def test_grouped_linear_refuses_shapes_that_do_not_fit():
    gen = torch.Generator().manual_seed(1)
    _, stacked = _stacked("INT4_G128", 2, 16, 128, gen)
    r = route(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), 3)
    with pytest.raises(ValueError, match="rows"):
        grouped_linear(torch.zeros(3, 128, device=DEVICE), stacked, r)
    r = route(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="x must be"):
        grouped_linear(torch.zeros(3, 64, device=DEVICE), stacked, r)


def test_stack_is_the_layout_of_the_concatenated_codes():
    gen = torch.Generator().manual_seed(5)
    for fmt in ("INT3_G128", "INT4_G64_ASYM", "NVFP4_G16"):
        experts, stacked = _stacked(fmt, 3, 16, 128, gen)
        got = stack(experts)
        for attr in ("qweight", "qweight_hi", "scales", "zeros"):
            a, b = getattr(got, attr), getattr(stacked, attr)
            assert (a is None and b is None) or torch.equal(a, b)
        assert got.shape == stacked.shape and got.global_scale == stacked.global_scale
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(unpack(got.rows(16, 32)), unpack(experts[1])))
    with pytest.raises(ValueError):
        stack([packed_weight("INT4_G128", 16, 128, gen), packed_weight("INT2_G128", 16, 128, gen)])


def test_a_loaded_moe_model_runs_its_experts_grouped(tmp_path, monkeypatch):
    """``dynaquant.load`` of a Qwen3-MoE checkpoint (the kernels' op, their CPU interpreter standing in for CUDA):
    every experts module runs as two grouped launches, its experts' layouts stacked (one copy: no expert keeps its
    own), its outputs the per-expert loop's, ``state_dict`` the checkpoint's bit for bit."""
    import transformers
    from test_moe_gguf import _BASE, MOE
    from test_moe_runtime import _direct_plan

    import dynaquant.kernels as kernels
    import dynaquant.runtime.linear as rt_linear
    import dynaquant.runtime.loader as rt
    from dynaquant.exporters.safetensors.writer import unquantized_linears, write_safetensors
    from dynaquant.quant.runtime import encode
    from dynaquant.runtime.moe import DynaExperts, checkpoint_weights, encode_experts

    arch, cfg, _ = MOE["qwen3moe"]
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**_BASE, **cfg})
    config.architectures = [arch]
    torch.manual_seed(0)
    model = cls(config).eval()
    weights = checkpoint_weights(model)
    plan = _direct_plan(model, weights, bpw=5.5)
    write_safetensors(tmp_path / "q", plan, weights,
                      lambda e, w: encode_experts(w, e.format) if w.ndim == 3 else encode(w, e.format),
                      model.config.to_dict(), ignore=unquantized_linears(model, plan), progress=False)
    if not HAS_CUDA:  # (on CUDA: the kernels as dynaquant.load picks them)
        monkeypatch.setattr(rt_linear, "_kernel_device", lambda t: True)
        monkeypatch.setattr(rt_linear, "kernel_op", lambda fmt: rt_linear._PackLinearOp(kernels))
    loop = rt.load(tmp_path / "q", device=DEVICE, dtype=torch.bfloat16, fuse=False)
    grouped = rt.load(tmp_path / "q", device=DEVICE, dtype=torch.bfloat16)
    mods = [m for m in grouped.modules() if isinstance(m, DynaExperts)]
    assert mods and all(m.grouped is not None for m in mods)
    assert all(lin._packed is None and lin._fused is not None
               for m in mods for lin in m.modules() if isinstance(lin, rt.DynaLinear))
    sa, sb = loop.state_dict(), grouped.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    if HAS_CUDA:  # the whole model natively (the interpreter would take minutes)
        ids = torch.tensor([[1, 5, 9, 200, 7, 33, 2, 64]], device=DEVICE)
        with torch.no_grad():
            a, b = loop(ids).logits.float(), grouped(ids).logits.float()
        assert float((a - b).abs().max()) <= 0.02 * float(a.abs().max())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 256, generator=gen).to(torch.bfloat16).to(DEVICE)  # (the experts alone: the interpreter is slow)
    idx = torch.randint(0, 4, (7, 2), generator=gen)
    idx[3, 0] = -1  # a masked choice
    idx = idx.to(DEVICE)
    w = torch.rand(7, 2, generator=gen).to(torch.bfloat16).to(DEVICE)
    one, ref = mods[0], loop.model.layers[0].mlp.experts
    with torch.no_grad():
        want = ref(x, idx, w).float()
        got = one(x, idx, w).float()
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
        silu = one.act_fn
        one.act_fn = ref.act_fn = transformers.activations.ACT2FN["gelu"]  # not SiLU: the torch activation after
        want_gelu, got_gelu = ref(x, idx, w).float(), one(x, idx, w).float()
        assert float((got_gelu - want_gelu).abs().max()) <= 0.02 * float(want_gelu.abs().max())
        assert float((got_gelu - got).abs().max()) > 0.05 * float(want.abs().max())
        one.act_fn = ref.act_fn = silu
        one.expert(1).up_proj.prepare()  # taken out of its group: the experts loop again, each on its own rows
        assert not one.grouped[0].intact
        again = one(x, idx, w).float()
    assert float((again - want).abs().max()) <= 0.02 * float(want.abs().max())
