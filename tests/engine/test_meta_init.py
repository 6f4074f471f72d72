"""Loading the models on a CPU imports no GPU compiler (torch._dynamo, Triton): building a module's structure on
the meta device leaves its initial weights undrawn (cosystream.engine.meta_init)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from cosystream.engine.meta_init import weights_left_uninitialized

_LOAD = """
import sys
from cosystream.checkpoint import load_checkpoint
from cosystream.engine.loader import load_flow, load_hift, load_llm
checkpoint = load_checkpoint(sys.argv[1])
load_llm(checkpoint), load_flow(checkpoint), load_hift(checkpoint)
print("imported:", sorted(m for m in ("triton", "torch._dynamo") if m in sys.modules))
"""


def test_loading_the_models_on_a_cpu_imports_no_gpu_compiler(model_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _LOAD, str(model_dir)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "imported: []"
    assert "nanobind" not in done.stderr


def test_the_fills_come_back_after_building():
    normal = torch.nn.init.normal_
    with torch.device("meta"), weights_left_uninitialized():
        layer = torch.nn.Linear(4, 3)
        assert torch.nn.init.normal_ is not normal
    assert torch.nn.init.normal_ is normal and layer.weight.is_meta
    filled = torch.nn.init.normal_(torch.zeros(1000))
    assert filled.std() > 0.5  # a real fill again
