"""diffuse.model.meta: modules built for their shapes run no initialiser, in this thread only,
and loading a model does not pull in torch's compiler stack (a process start's second)."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from diffuse.model.meta import on_meta
from tiny import make_tiny


def test_on_meta_builds_shapes_and_other_threads_still_initialise():
    built: list[torch.nn.Linear] = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        built.append(torch.nn.Linear(64, 64))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with on_meta():
        layer = torch.nn.Linear(8, 4)
        norm = torch.nn.RMSNorm(4)
        inside.set()
        assert done.wait(10)
    thread.join(10)
    assert layer.weight.is_meta and layer.weight.shape == (4, 8) and norm.weight.is_meta
    assert not built[0].weight.is_meta and built[0].weight.abs().sum() > 0  # kaiming's draw, not zeros
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the mode is gone


def test_loading_a_model_leaves_dynamo_and_sympy_unimported(tmp_path):
    path = make_tiny(tmp_path / "tiny")
    code = f"""
import sys
from pathlib import Path
import torch
from diffuse.model.config import ModelConfig
from diffuse.model.engine import block_parameters
from diffuse.model.load import load_head, load_span
path = Path({str(path)!r})
head, span = load_head(path, torch.bfloat16), load_span(path, 0, 4, torch.bfloat16)
block_parameters(ModelConfig.load(path), 1)
assert head.embed.weight.dtype == torch.bfloat16 and not head.embed.weight.is_meta
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
