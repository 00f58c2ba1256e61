"""dynaquant.quant.codecs.consts: the searches' constant tables made once per (values, dtype, device)."""

from __future__ import annotations

import torch

from dynaquant.quant.codecs.consts import device_constant


def test_device_constant_is_made_once_and_equals_torch_tensor():
    a = device_constant([1.5, 2.0, 3.25], torch.float32, "cpu")
    assert torch.equal(a, torch.tensor([1.5, 2.0, 3.25]))
    assert device_constant((1.5, 2.0, 3.25), torch.float32, torch.device("cpu")) is a  # list or tuple: one entry
    assert device_constant([1.5, 2.0, 3.25], torch.float64, "cpu") is not a  # the dtype is part of the key
    assert device_constant([1.5, 2.0, 3.25], torch.float64, "cpu").dtype == torch.float64


def test_device_constant_nested_values_keep_their_shape():
    m = device_constant([[1, 0], [0, -1], [2, 1]], torch.int32, "cpu")
    assert m.shape == (3, 2) and m.dtype == torch.int32
    assert torch.equal(m, torch.tensor([[1, 0], [0, -1], [2, 1]], dtype=torch.int32))
