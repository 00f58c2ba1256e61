"""Non-finite weights (NaN, +-Inf): refused by default, or replaced with ``allow_nonfinite``.

A NaN or an Inf in a weight makes every format's block scale NaN or Inf: Q8_0 writes the whole block as
zeros, the K-quants write NaNs, and a calibration forward pass produces NaN logits. So every tensor read
for quantization is checked (:func:`all_finite`: its sum, one pass over memory already read), and so is a
model loaded for calibration, before its first forward pass.

With ``allow_nonfinite`` the values are replaced, with a logged warning per tensor:

- NaN -> 0 (the value carries no information; 0 is what an absent weight contributes);
- +-Inf -> +-the largest finite ``|value|`` of the same tensor (0 if it has none).

Clamping to the tensor's own largest magnitude, rather than to its dtype's largest value (3.4e38 for
float32, 65504 for float16), keeps every block scale in the tensor's range: a dtype maximum would make the
block's scale so large that every other weight of the block rounds to zero, and overflows again as soon as
a block sums or squares it (a float16 scale, an imatrix-weighted error). The output is then finite in every
format.
"""

from __future__ import annotations

import logging

import torch

from dynaquant.errors import InputError

log = logging.getLogger(__name__)

ALLOW_HINT = ("pass --allow-nonfinite (allow_nonfinite=True) to write NaN as 0 and +-Inf as +-the tensor's largest "
              "finite |value|")


def _first_position(bad: torch.Tensor) -> list[int]:
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())  # first True: no index list of every bad value
    pos = []
    for n in reversed(bad.shape):
        pos.append(flat % n)
        flat //= n
    return pos[::-1]


def replace_nonfinite(w: torch.Tensor) -> torch.Tensor:
    """``w`` with NaN -> 0 and +-Inf -> +-max finite |w| (0 if none); a new tensor of ``w``'s dtype and shape."""
    finite = w[torch.isfinite(w)]
    m = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.nan_to_num(w, nan=0.0, posinf=m, neginf=-m)


def all_finite(w: torch.Tensor) -> bool:
    """Whether every value of the float tensor ``w`` is finite: its sum is (NaN and Inf reach any sum: NaN + x is NaN,
    Inf + finite is Inf, Inf - Inf is NaN), one reduction, many times faster on a CPU than ``isfinite(w).all()``;
    a sum that overflows (finite values only) is settled by ``isfinite(w).all()``. float32 accumulation (float64
    for float64 tensors)."""
    if bool(torch.isfinite(w.sum(dtype=torch.float64 if w.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(w).all())


def check_finite(w: torch.Tensor, tensor: str, file: str, allow_nonfinite: bool = False) -> torch.Tensor:
    """Return ``w`` if every value is finite; else raise, or (``allow_nonfinite``) return it with the
    non-finite values replaced (see the module docstring) and log a warning.

    Args:
        w: any shape; integer and packed (uint8) tensors are returned unchecked.
        tensor: how to name it (``"tensor model.layers.0.mlp.down_proj.weight (GGUF blk.0.ffn_down.weight)"``).
        file: the file it was read from; the message starts with it.
    Raises:
        InputError: a NaN or Inf and not ``allow_nonfinite``; names the file, the tensor, the count of NaN and
            Inf values and the first position, and ``--allow-nonfinite``.
    """
    if not w.is_floating_point() or all_finite(w):
        return w
    bad = ~torch.isfinite(w)
    n_bad, n_nan = int(bad.sum()), int(torch.isnan(w).sum())
    what = (f"{file}: {tensor} has {n_bad} non-finite value{'s' if n_bad > 1 else ''} "
            f"({n_nan} NaN, {n_bad - n_nan} Inf), the first at {_first_position(bad)}")
    if not allow_nonfinite:
        raise InputError(f"{what}; quantized or calibrated on, it gives corrupt results. Fix the checkpoint, or {ALLOW_HINT}")
    log.warning("%s; --allow-nonfinite: NaN -> 0, +-Inf -> +-the tensor's largest finite |value|", what)
    return replace_nonfinite(w)


def tensor_label(hf_name: str | None, gguf_name: str | None) -> str:
    """``"tensor model.layers.0.mlp.down_proj.weight (GGUF blk.0.ffn_down.weight)"``: both names where known."""
    if hf_name and gguf_name:
        return f"tensor {hf_name} (GGUF {gguf_name})"
    return f"tensor {hf_name or gguf_name}"


def source_names(ts) -> dict[str, tuple[str, str]]:
    """HF name -> (GGUF name, file) for every tensor of a ``TensorSource`` that has an HF name."""
    return {t.hf_name: (t.gguf_name, ts.file_of(t)) for t in ts.tensors() if t.hf_name}


def check_model_finite(model: torch.nn.Module, names: dict[str, tuple[str, str]], file: str,
                       allow_nonfinite: bool = False) -> None:
    """Check every parameter of a loaded model before its first forward pass; with ``allow_nonfinite``
    replace the non-finite values in place.

    Args:
        names: HF parameter name -> (GGUF name, file holding it), for the message; ``file`` serves the others.
    Raises:
        InputError: as :func:`check_finite`, for the first parameter (in the model's order) with a NaN or Inf.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            gguf_name, where = names.get(name, (None, file))
            fixed = check_finite(p.data, tensor_label(name, gguf_name), where, allow_nonfinite)
            if fixed is not p.data:
                p.data.copy_(fixed)
