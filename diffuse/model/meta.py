"""Modules built for their shapes only, before weights are read over them."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

init = torch.nn.init
# What nn.Linear, nn.Embedding and nn.RMSNorm initialise parameters with, and the methods below.
_INITIALISERS = {init.uniform_, init.normal_, init.kaiming_uniform_, init.ones_, init.zeros_, init.constant_,
                 torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_}


class _NoInit(TorchFunctionMode):
    """Initialisers return a meta tensor untouched (a mode is per thread: others still initialise)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built here have meta parameters, and no initialiser runs: a random init would be
    overwritten by the weights, and the first initialiser called on a meta tensor imports
    torch._dynamo (in torch 2.13), which slows every process's start."""
    with torch.device("meta"), _NoInit():
        yield
