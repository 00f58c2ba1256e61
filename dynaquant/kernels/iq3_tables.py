"""The IQ3 search kernels' tables on a device (:mod:`.iq3_search`), built once per grid and cached.

:func:`float_tables`: the grid and its squares as float32 and the level-pattern map; :func:`candidate_lists`: the
exact candidate lists of every level pattern; :func:`packed_points`: the grid's points as single int32 words (one load
a point); :func:`launch_tables`: the arguments a launch takes. No Triton here.
"""

from __future__ import annotations

import numpy as np
import torch

from dynaquant.quant.codecs import _lattice as lat

__all__ = ["candidate_lists", "float_tables", "launch_tables", "packed_points", "packed_tables"]

_TABLES: dict = {}


def float_tables(grid: torch.Tensor, kmap: torch.Tensor, mids: torch.Tensor, device):
    """(grid, grid**2 float32, kmap int64, mids float32), contiguous on ``device``, cached per table (the codecs pass
    the same cached tables every call: no conversions or launches a call)."""
    key = (grid.data_ptr(), kmap.data_ptr(), mids.data_ptr(), str(device))
    if key not in _TABLES:
        gc = grid.to(device=device, dtype=torch.float32).contiguous()
        _TABLES[key] = (grid, kmap, mids, gc, gc * gc, kmap.to(device=device, dtype=torch.int64).contiguous(),
                        mids.to(device=device, dtype=torch.float32).contiguous())  # (the inputs kept: their addresses are the key)
    return _TABLES[key][3:]


_LISTS: dict = {}


def candidate_lists(grid: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cand (4096, K) int32, count (4096,) int32) on ``device``: the exact candidate lists of a grid of 8 levels
    (:func:`dynaquant.quant.codecs._lattice.dominance_candidates`, the lists the CPU search walks), cached per grid."""
    key = (grid.data_ptr(), tuple(grid.shape), str(grid.device), str(device))
    if key not in _LISTS:
        gn = grid.detach().to("cpu", torch.float32).numpy()
        cand, cnt = lat.dominance_candidates(np.searchsorted(np.unique(gn), gn), 8)
        _LISTS[key] = (grid, cand.to(device=device, dtype=torch.int32).contiguous(),
                       cnt.to(device=device, dtype=torch.int32).contiguous())  # (the grid kept: its address is the key)
    return _LISTS[key][1:]


def packed_points(grid: torch.Tensor, kmap: torch.Tensor, cand: torch.Tensor):
    """The grid's points as single int32 words, for one load a lookup or a candidate, or None when they don't fit.

    Coordinate ``j`` of a point is field ``j`` (``FB`` bits at bit ``FB j``) times ``GSTEP`` (the coordinates' greatest
    common divisor, so the product is the exact float32 coordinate); the point's index sits above the four fields.
    IQ3_XXS (values 4 .. 62, step 2): FB = 5 and 8 index bits; IQ3_S (1 .. 15, step 1): FB = 4 and 9 index bits.

    Args:
        grid: (P, 4) float32 points (non-negative integers); kmap: (4096,) int64 level pattern -> index (-1 off the
            grid); cand: (4096, K) int64 candidate lists (:func:`dynaquant.quant.codecs._lattice.dominance_candidates`).
    Returns:
        (pts (P,) int32 word of each point, kpk (4096,) int32 ``kmap``'s words (-1 off the grid), cpk (4096, K) int32
        the lists' words, FB, GSTEP) on the CPU, or None: coordinates that are not small non-negative integers, or
        words over 31 bits.
    """
    g = grid.detach().to("cpu", torch.float64)
    if g.numel() == 0 or bool((g != g.round()).any() | (g < 0).any() | (g > 255).any()):
        return None
    gi = g.long()
    step = int(np.gcd.reduce(gi.reshape(-1).numpy()))
    step = max(step, 1)
    fields = gi // step
    fb = max(1, int(fields.max()).bit_length())
    if 4 * fb + max(1, grid.shape[0] - 1).bit_length() > 31:
        return None
    pts = (fields << (fb * torch.arange(4))).sum(1) | (torch.arange(grid.shape[0]) << (4 * fb))
    km = kmap.detach().to("cpu", torch.int64)
    kpk = torch.where(km >= 0, pts[km.clamp_min(0)], -1)
    cpk = pts[cand.to(torch.int64)]
    return pts.to(torch.int32), kpk.to(torch.int32), cpk.to(torch.int32), fb, float(step)


def launch_tables(grid: torch.Tensor, kmap: torch.Tensor, mids: torch.Tensor, device, packed: bool):
    """The kernels' table arguments on ``device``: (grid, grid**2, mids, the map, the packed points, the candidate
    lists, their counts, FB, GSTEP); ``packed`` and a grid that fits :func:`packed_points`: the map and the lists as
    packed words, FB > 0; else ``kmap`` and index lists (the packed points' slot holds the grid), FB = 0."""
    gc, g2, kc, mc = float_tables(grid, kmap, mids, device)
    cand, cnt = candidate_lists(grid, device)
    pk = packed_tables(grid, kmap, device) if packed else None
    if pk is None:
        return gc, g2, mc, kc, gc, cand, cnt, 0, 1.0
    pts, kpk, cpk, fb, gstep = pk
    return gc, g2, mc, kpk, pts, cpk, cnt, fb, gstep


_PACKED: dict = {}


def packed_tables(grid: torch.Tensor, kmap: torch.Tensor, device):
    """:func:`packed_points` of a grid on ``device`` (or None), cached per table like :func:`float_tables`."""
    key = (grid.data_ptr(), kmap.data_ptr(), tuple(grid.shape), str(device))
    if key not in _PACKED:
        pk = packed_points(grid, kmap, candidate_lists(grid, device)[0].cpu())
        tabs = None if pk is None else (*(t.to(device).contiguous() for t in pk[:3]), *pk[3:])
        _PACKED[key] = (grid, kmap, tabs)  # (the inputs kept: their addresses are the key)
    return _PACKED[key][2]
