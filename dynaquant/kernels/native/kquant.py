"""The K-quant searches' steps 1 to 3 on the CPU, compiled (``kquant_search.c``): the CPU fast paths
``kquant.sym_search_scales``, ``kquant.aff_search_scales``, ``kquant.sym_pick``, ``kquant.aff_pick``,
``kquant.sym_refine``, ``kquant.aff_refine``, the whole searches ``kquant.sym_encode`` (Q3_K, Q6_K) and
``kquant.aff_encode`` (Q2_K, Q4_K, Q5_K), and the symmetric blocks' bytes ``kquant.sym_bytes``, of
:mod:`dynaquant.quant.codecs.fastpaths`, with the signatures and returns of their torch references in
:mod:`dynaquant.quant.codecs._kquant_search` and :mod:`dynaquant.quant.codecs.kquants` (shapes and dtypes there).
Raises RuntimeError (from :func:`dynaquant.kernels.native.library`) when the library cannot be built.
"""

from __future__ import annotations

import ctypes

import torch

from dynaquant.kernels.native import cpu_contiguous, library, ptr, split_rows
from dynaquant.quant.codecs._kquant_search import AffConfig, SymConfig, sym_bytes_layout

_I64, _INT = ctypes.c_int64, ctypes.c_int
_MAX_L = 32
_MAX_MIDS = 256
_MAX_S = 64
_MAX_S_SYM = 16  # sub-blocks of a symmetric super-block (kquant_search.c's MAX_S_SYM)
_MAX_CAND = 512  # step-1 candidates of one phase (kquant_search.c's MAX_CAND)


def _lib() -> ctypes.CDLL:
    lib = library("kquant_search")
    if not getattr(lib, "_dq_typed", False):
        vp = ctypes.c_void_p
        lib.dq_sym_search_scales.argtypes = [vp, vp, _I64, _INT, _INT, _INT, vp, _INT, _INT, _INT, _INT, vp]
        lib.dq_aff_search_scales.argtypes = [vp, vp, _I64, _INT, _INT, vp, _INT, vp, _INT, _INT, vp, vp]
        lib.dq_sym_pick.argtypes = [vp, vp, vp, vp, _I64, _INT, _INT, _INT, _INT, _INT, _INT, _INT, vp, _INT, _INT, vp, vp]
        lib.dq_aff_pick.argtypes = [vp, _I64, _INT, _INT, vp, vp, _INT, vp, vp, vp, vp]
        lib.dq_sym_refine.argtypes = [vp, vp, _I64, _INT, _INT, vp, vp, _INT, _INT, _INT, _INT, vp]
        lib.dq_aff_refine.argtypes = [vp, vp, _I64, _INT, _INT, vp, vp, vp, vp, _INT, _INT, vp, _INT, vp]
        lib.dq_sym_encode.argtypes = [vp, vp, _I64, _INT, _INT, _INT, _INT, _INT, _INT, vp, _INT, _INT, _INT, _INT, vp, _INT,
                                      _INT, _INT, _INT, vp, vp]
        lib.dq_sym_encode.restype = _INT
        lib.dq_aff_encode.argtypes = [vp, vp, _I64, _INT, _INT, _INT, _INT, vp, _INT, vp, _INT, _INT, vp, _INT, vp, _INT, _INT,
                                      _INT, vp, vp, vp, vp]
        lib.dq_aff_encode.restype = _INT
        lib.dq_sym_bytes.argtypes = [vp, _I64, vp, vp, _INT, vp]
        lib.dq_sym_bytes.restype = None
        for f in (lib.dq_sym_search_scales, lib.dq_aff_search_scales, lib.dq_sym_pick, lib.dq_aff_pick, lib.dq_sym_refine,
                  lib.dq_aff_refine):
            f.restype = None
        lib._dq_typed = True
    return lib


def build() -> None:
    """Build (or find) the library: the fast paths' loader calls it first (:func:`dynaquant.kernels._loader`)."""
    _lib()


def _f32(values) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def _check_candidates(spec) -> None:
    """Step 1's candidate counts within the C side's buffers (ValueError otherwise)."""
    n = len(spec.steps) * len(getattr(spec, "shifts", (0, 0)))
    levels = spec.qhi - spec.qlo if hasattr(spec, "qhi") else 0
    if n > _MAX_CAND or levels > _MAX_CAND:
        raise ValueError(f"step 1 tries {n} candidate scales and {levels} levels a phase: at most {_MAX_CAND}")


def _sub_blocks(x: torch.Tensor, w: torch.Tensor):
    if x.ndim != 3 or w.shape != x.shape or x.shape[-1] > _MAX_L:
        raise ValueError(f"expected x, w of one shape (n_super, n_sub, sub_size <= {_MAX_L}), "
                         f"got {tuple(x.shape)}, {tuple(w.shape)}")
    return cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)


def sym_search_scales(x: torch.Tensor, w: torch.Tensor, spec, iters: int = 2) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs._kquant_search.sym_search_scales_torch`."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    if spec.exhaustive and L * max(-spec.qlo, spec.qhi) > _MAX_MIDS:
        raise ValueError(f"exhaustive search of {L} x {max(-spec.qlo, spec.qhi)} breakpoints: at most {_MAX_MIDS}")
    _check_candidates(spec)
    lib, steps, n = _lib(), _f32(spec.steps), B * S
    out = torch.empty(B, S, dtype=torch.float64)

    def run(i0, i1):
        lib.dq_sym_search_scales(ptr(x, i0 * L), ptr(w, i0 * L), i1 - i0, L, spec.qlo, spec.qhi, ptr(steps), len(steps),
                                 int(bool(spec.exhaustive)), int(spec.n_elem), iters, ptr(out, i0))

    split_rows(n, run)
    return out


def aff_search_scales(x: torch.Tensor, w: torch.Tensor, spec, iters: int = 3):
    """As :func:`dynaquant.quant.codecs._kquant_search.aff_search_scales_torch`."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    _check_candidates(spec)
    lib, steps, shifts, n = _lib(), _f32(spec.steps), _f32(spec.shifts), B * S
    a = torch.empty(B, S, dtype=torch.float64)
    b = torch.empty(B, S, dtype=torch.float64)

    def run(i0, i1):
        lib.dq_aff_search_scales(ptr(x, i0 * L), ptr(w, i0 * L), i1 - i0, L, spec.qmax, ptr(steps), len(steps), ptr(shifts),
                                 len(shifts), iters, ptr(a, i0), ptr(b, i0))

    split_rows(n, run)
    return a, b


def sym_pick(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, sqq: torch.Tensor, spec, cand: torch.Tensor,
             clip: bool = False):
    """As :func:`dynaquant.quant.codecs._kquant_search.sym_pick_torch`."""
    x, w = _sub_blocks(x, w)
    if x.shape[1] > _MAX_S_SYM:
        raise ValueError(f"at most {_MAX_S_SYM} sub-blocks a symmetric super-block, got {x.shape[1]}")
    a, sqq, cand = (cpu_contiguous(t, torch.float32) for t in (a, sqq, cand))
    B, S = a.shape
    L = x.shape[-1]
    C = cand.shape[1]
    lib = _lib()
    d = torch.empty(B, dtype=torch.float32)
    k = torch.empty(B, S, dtype=torch.int64)

    def run(i0, i1):
        lib.dq_sym_pick(ptr(x, i0 * S * L), ptr(w, i0 * S * L), ptr(a, i0 * S), ptr(sqq, i0 * S), i1 - i0, S, L, spec.qlo,
                        spec.qhi, spec.klo, spec.khi, spec.clip_max, ptr(cand, i0 * C), C, int(bool(clip)), ptr(d, i0),
                        ptr(k, i0 * S))

    split_rows(B, run)
    return d, k


def aff_pick(ref, kmax: int, dc: torch.Tensor, mc: torch.Tensor):
    """As :func:`dynaquant.quant.codecs._kquant_search.aff_pick_torch` (``ref``: :func:`aff_reference`'s 7 tensors)."""
    B, S = ref[0].shape
    if S > _MAX_S:
        raise ValueError(f"at most {_MAX_S} sub-blocks a super-block, got {S}")
    r = torch.stack([cpu_contiguous(t, torch.float32) for t in ref])  # (7, B, S)
    dc, mc = cpu_contiguous(dc, torch.float32), cpu_contiguous(mc, torch.float32)
    C = dc.shape[1]
    lib = _lib()
    d = torch.empty(B, dtype=torch.float32)
    m = torch.empty(B, dtype=torch.float32)
    ks = torch.empty(B, S, dtype=torch.int64)
    km = torch.empty(B, S, dtype=torch.int64)

    def run(i0, i1):
        # ref's planes are whole (B, S): the C side indexes plane t at t * B * S, so it gets the full ref and the
        # super-block offset through dc/mc/out pointers; here the chunk's planes are sliced instead
        sub = r[:, i0:i1].contiguous()
        lib.dq_aff_pick(ptr(sub), i1 - i0, S, kmax, ptr(dc, i0 * C), ptr(mc, i0 * C), C, ptr(d, i0), ptr(m, i0),
                        ptr(ks, i0 * S), ptr(km, i0 * S))

    split_rows(B, run)
    return d, m, ks, km


def sym_refine(x: torch.Tensor, w: torch.Tensor, cfg: SymConfig, spec):
    """As :func:`dynaquant.quant.codecs._kquant_search.sym_refine_torch`."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    lib, d = _lib(), cpu_contiguous(cfg.d, torch.float32)
    k = cfg.k.to(device="cpu", dtype=torch.int64, copy=True).contiguous()
    err = torch.empty(B, dtype=torch.float64)

    def run(i0, i1):
        lib.dq_sym_refine(ptr(x, i0 * S * L), ptr(w, i0 * S * L), i1 - i0, S, L, ptr(d, i0), ptr(k, i0 * S), spec.qlo,
                          spec.qhi, spec.klo, spec.khi, ptr(err, i0))

    split_rows(B, run)
    return SymConfig(cfg.d, k), err


def aff_refine(x: torch.Tensor, w: torch.Tensor, cfg: AffConfig, spec):
    """As :func:`dynaquant.quant.codecs._kquant_search.aff_refine_torch`."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    lib = _lib()
    d, dmin = cpu_contiguous(cfg.d, torch.float32), cpu_contiguous(cfg.dmin, torch.float32)
    ks = cfg.ks.to(device="cpu", dtype=torch.int64, copy=True).contiguous()
    km = cfg.km.to(device="cpu", dtype=torch.int64, copy=True).contiguous()
    moves = torch.tensor(spec.moves, dtype=torch.int32).reshape(-1, 2).contiguous()
    err = torch.empty(B, dtype=torch.float64)

    def run(i0, i1):
        lib.dq_aff_refine(ptr(x, i0 * S * L), ptr(w, i0 * S * L), i1 - i0, S, L, ptr(d, i0), ptr(dmin, i0), ptr(ks, i0 * S),
                          ptr(km, i0 * S), spec.qmax, spec.kmax, ptr(moves), moves.shape[0], ptr(err, i0))

    split_rows(B, run)
    return AffConfig(cfg.d, cfg.dmin, ks, km), err


def sym_encode(x: torch.Tensor, w: torch.Tensor, spec) -> SymConfig:
    """As :func:`dynaquant.quant.codecs._kquant_search.sym_encode_torch` (steps 1-3, ``spec.rounds`` rounds), the
    steps between the searches compiled too. Raises MemoryError when the C side cannot allocate its buffers."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    if spec.exhaustive and L * max(-spec.qlo, spec.qhi) > _MAX_MIDS:
        raise ValueError(f"exhaustive search of {L} x {max(-spec.qlo, spec.qhi)} breakpoints: at most {_MAX_MIDS}")
    if S > _MAX_S_SYM:
        raise ValueError(f"at most {_MAX_S_SYM} sub-blocks a symmetric super-block, got {S}")
    _check_candidates(spec)
    lib, steps = _lib(), _f32(spec.steps)
    ds = torch.tensor([float(t) for t in spec.d_grid()], dtype=torch.float64)
    d = torch.empty(B, dtype=torch.float32)
    k = torch.empty(B, S, dtype=torch.int64)

    def run(i0, i1):
        rc = lib.dq_sym_encode(ptr(x, i0 * S * L), ptr(w, i0 * S * L), i1 - i0, S, L, spec.qlo, spec.qhi, spec.klo, spec.khi,
                               ptr(steps), len(steps), int(bool(spec.exhaustive)), int(spec.n_elem), 2, ptr(ds), len(ds),
                               len(spec.d_steps), spec.rounds, spec.clip_max, ptr(d, i0), ptr(k, i0 * S))
        if rc:
            raise MemoryError(f"the compiled K-quant search could not allocate buffers for {i1 - i0} super-blocks")

    split_rows(B, run)
    return SymConfig(d, k)


def aff_encode(x: torch.Tensor, w: torch.Tensor, spec) -> AffConfig:
    """As :func:`dynaquant.quant.codecs._kquant_search.aff_encode_torch` (steps 1-3, ``spec.rounds`` rounds), the
    steps between the searches compiled too. Raises MemoryError when the C side cannot allocate its buffers."""
    x, w = _sub_blocks(x, w)
    B, S, L = x.shape
    if S > _MAX_S:
        raise ValueError(f"at most {_MAX_S} sub-blocks a super-block, got {S}")
    _check_candidates(spec)
    lib, steps, shifts, ds = _lib(), _f32(spec.steps), _f32(spec.shifts), _f32(spec.d_steps)
    moves = torch.tensor(spec.moves, dtype=torch.int32).reshape(-1, 2).contiguous()
    d = torch.empty(B, dtype=torch.float32)
    m = torch.empty(B, dtype=torch.float32)
    ks = torch.empty(B, S, dtype=torch.int64)
    km = torch.empty(B, S, dtype=torch.int64)

    def run(i0, i1):
        rc = lib.dq_aff_encode(ptr(x, i0 * S * L), ptr(w, i0 * S * L), i1 - i0, S, L, spec.qmax, spec.kmax, ptr(steps),
                               len(steps), ptr(shifts), len(shifts), 3, ptr(ds), len(ds), ptr(moves), moves.shape[0],
                               spec.rounds, int(bool(spec.widen)), ptr(d, i0), ptr(m, i0), ptr(ks, i0 * S),
                               ptr(km, i0 * S))
        if rc:
            raise MemoryError(f"the compiled K-quant search could not allocate buffers for {i1 - i0} super-blocks")

    split_rows(B, run)
    return AffConfig(d, m, ks, km)


def sym_bytes(format_name: str, x: torch.Tensor, cfg: SymConfig) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs.kquants.sym_bytes_torch`: the codes and their packing in one compiled pass
    (the torch version makes an int64 code tensor and a dozen shifted copies of it). Raises ValueError for another
    format or shape."""
    qbits, tsize = sym_bytes_layout(format_name, x, cfg, "compiled")
    n = x.shape[0]
    x = cpu_contiguous(x, torch.float32)
    d, k = cpu_contiguous(cfg.d, torch.float32), cpu_contiguous(cfg.k, torch.int64)
    out = torch.empty(n, tsize, dtype=torch.uint8)
    lib = _lib()

    def run(i0, i1):
        lib.dq_sym_bytes(ptr(x, i0 * 256), i1 - i0, ptr(d, i0), ptr(k, i0 * 16), qbits, ptr(out, i0 * tsize))

    split_rows(n, run)
    return out
