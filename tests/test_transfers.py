"""cosystream.transfers: host tensors onto the device, their values and dtypes as `Tensor.to` gives them, and
results back to the host in one copy."""

from __future__ import annotations

import numpy as np
import torch

from cosystream.transfers import ints_to_device, to_device, to_host


def test_to_device_converts_on_the_way_as_tensor_to_does():
    t = torch.tensor([0.5, -1.25, 3.0])
    out = to_device(t, "cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, t.to(torch.bfloat16))
    assert to_device(t, torch.device("cpu")) is t  # already there: the tensor itself, as Tensor.to gives it


def test_ints_to_device_are_long_by_default():
    out = ints_to_device([3, 1, 2], "cpu")
    assert out.dtype == torch.long and out.tolist() == [3, 1, 2]
    assert ints_to_device([7], "cpu", torch.int32).dtype == torch.int32


def test_to_host_gives_each_tensor_as_its_own_array_in_one_copy():
    tensors = [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.zeros(0), torch.tensor([1.5, -2.0])]
    arrays = to_host(tensors)
    assert [a.shape for a in arrays] == [(2, 3), (0,), (2,)]
    for array, tensor in zip(arrays, tensors, strict=True):
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, tensor.float().numpy())
    assert to_host([]) == []
