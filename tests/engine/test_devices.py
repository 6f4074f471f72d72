"""The engine's device when none is named, and a clear error (not torch's bare AssertionError) for a missing one."""

from __future__ import annotations

import pytest
import torch

from cosystream.engine.devices import check_device, with_device_defaults
from cosystream.errors import CosyStreamError


def test_the_device_that_exists_is_the_default():
    got = with_device_defaults({"max_streams": 2})
    if torch.cuda.is_available():
        assert (got["device"], got["dtype"]) == ("cuda", "bfloat16")
    else:
        assert (got["device"], got["dtype"]) == ("cpu", "float32")
    assert got["max_streams"] == 2
    assert with_device_defaults({"device": "cpu", "dtype": "bfloat16"})["dtype"] == "bfloat16"  # kept as given


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_on_a_machine_without_one_says_what_is_missing():
    with pytest.raises(CosyStreamError, match="device: 'cuda'.*sees no CUDA GPU.*device='cpu'"):
        check_device("cuda")
    with pytest.raises(CosyStreamError):
        with_device_defaults({"device": "cuda:1"})
    check_device("cpu")
