"""dynaquant.kernels: Triton dequant-matmul kernels for the safetensors runtime formats.

Public API (importing this package does not import Triton):
    KernelFormat.parse(name) -> KernelFormat           the format as the kernels see it
    pack(codes, scales, zeros, fmt, *, global_scale=None, super_weights=None) -> PackedWeight
    stack([packed, ...]) -> PackedWeight                weights stacked along N (a MoE layer's experts)
    grouped.route / grouped.grouped_linear             every routed expert of a MoE layer in one launch
    linear(x, packed, bias=None, *, config=None) -> y  y = x @ dequant(W).T + bias (Triton on CUDA)
    dequantize(packed, dtype=torch.bfloat16) -> W      (N, K)
    dequantize_ref(codes, scales, zeros, fmt, *, global_scale=None) -> (N, K) float32
    linear_ref(x, packed, bias=None) -> y              torch reference of ``linear``
    choose_config(fmt, m, n, k, device_info(device)) -> LaunchConfig   cached launch tuning

Importing this package also registers the fused lattice searches of :mod:`.lattice_search`,
IQ3's fused assignment of :mod:`.iq3_search` and the fused K-quant scale searches of
:mod:`.kquant_search` (Triton, loaded on first use) as
the CUDA fast paths of the i-quant and K-quant codecs, and the compiled C K-quant, one-scale and
lattice (i-quant) searches of :mod:`.native` (built on first use) as their CPU fast paths
(:mod:`dynaquant.quant.codecs.fastpaths`); the layers that encode (pipeline, analysis, runtime)
import it.
"""

from dynaquant.kernels.formats import KernelFormat
from dynaquant.kernels.ops import dequantize, dequantize_packed_ref, linear, linear_ref, uses_triton
from dynaquant.kernels.packing import PackedWeight, pack, stack, unpack
from dynaquant.kernels.reference import dequantize_ref, e2m1_to_float, e8m0_to_float
from dynaquant.kernels.tuning import (
    DeviceInfo,
    LaunchConfig,
    choose_config,
    device_info,
    gemm_candidates,
    gemv_candidates,
    valid_config,
)
from dynaquant.quant.codecs import fastpaths


def _loader(module: str, attr: str, build: bool = False):
    """A loader of ``module``'s ``attr`` (imports the module, and Triton, when called); ``build``: the module's
    compiled library is built (or found) first, so that a failed build falls back to the torch reference at lookup
    rather than failing the first call (:mod:`.native`)."""

    def load():
        import importlib

        mod = importlib.import_module(module)
        if build:
            mod.build()
        return getattr(mod, attr)

    return load


for _name, _attr in (("lattice.nearest_codewords", "nearest_codewords"), ("lattice.candidate_terms", "candidate_terms"),
                     ("lattice.subset_min_costs", "subset_min_costs"), ("iq1.ternary_nearest", "ternary_nearest"),
                     ("iq1.ternary_search", "ternary_search")):
    fastpaths.register(_name, _loader("dynaquant.kernels.lattice_search", _attr))
fastpaths.register("iq1.sub_scales", _loader("dynaquant.kernels.iq1_search", "sub_scales"))
fastpaths.register("iq2.stored_scale_costs", _loader("dynaquant.kernels.lattice_search", "stored_scale_costs"))
for _attr in ("fit_scale", "encode_scale", "fit_affine", "fit_int_zero"):
    fastpaths.register(f"blockfit.{_attr}", _loader("dynaquant.kernels.scalefit", _attr))
for _attr in ("fit_scale", "fit_pow2", "encode_scale", "encode_pow2"):
    fastpaths.register(f"blockfit.{_attr}", _loader("dynaquant.kernels.native.blockfit", _attr, True), device="cpu")
for _attr in ("nearest_codewords", "candidate_terms", "subset_min_costs"):
    fastpaths.register(f"lattice.{_attr}", _loader("dynaquant.kernels.native.lattice", _attr, True), device="cpu")
fastpaths.register("iq3.nearest_variants", _loader("dynaquant.kernels.iq3_search", "nearest_variants"))
fastpaths.register("iq3.assign", _loader("dynaquant.kernels.iq3_search", "assign"))
fastpaths.register("iq3.pick", _loader("dynaquant.kernels.iq3_scales", "pick"))
fastpaths.register("iq3.consider", _loader("dynaquant.kernels.iq3_search", "consider"))
fastpaths.register("iq3.exact", _loader("dynaquant.kernels.iq3_search", "exact"))
fastpaths.register("iq3.exact_levels", _loader("dynaquant.kernels.iq3_search", "exact_levels"))
fastpaths.register("iq3.step1", _loader("dynaquant.kernels.iq3_search", "step1"))
fastpaths.register("iq3.nearest_variants", _loader("dynaquant.kernels.native.lattice", "nearest_variants", True), device="cpu")
fastpaths.register("iq1.ternary_nearest", _loader("dynaquant.kernels.native.lattice", "ternary_nearest", True), device="cpu")
fastpaths.register("gptq.round_block", _loader("dynaquant.kernels.gptq_block", "round_block"))
for _attr in ("aff_search_scales", "aff_pick", "aff_refine", "sym_search_scales", "sym_pick", "sym_refine"):
    fastpaths.register(f"kquant.{_attr}", _loader("dynaquant.kernels.kquant_search", _attr))
    fastpaths.register(f"kquant.{_attr}", _loader("dynaquant.kernels.native.kquant", _attr, True), device="cpu")
for _attr in ("sym_encode", "aff_encode", "sym_bytes"):  # the whole searches and Q3_K/Q6_K's bytes
    fastpaths.register(f"kquant.{_attr}", _loader("dynaquant.kernels.native.kquant", _attr, True), device="cpu")
for _attr in ("sym_encode", "sym_bytes"):  # the symmetric search with its glue fused, and its bytes (Triton)
    fastpaths.register(f"kquant.{_attr}", _loader("dynaquant.kernels.kquant_search", _attr))

__all__ = ["KernelFormat", "PackedWeight", "LaunchConfig", "DeviceInfo", "pack", "unpack", "stack", "linear", "dequantize",
           "uses_triton", "dequantize_ref", "dequantize_packed_ref", "linear_ref", "e2m1_to_float", "e8m0_to_float",
           "choose_config", "device_info", "valid_config", "gemm_candidates", "gemv_candidates"]
