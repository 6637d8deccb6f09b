"""What every command shares: bootstrap addresses, running trio until a signal, options."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from diffuse.errors import DiffuseError, first_leaf

T = TypeVar("T")


def add_bootstrap_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                   help="a sentinel or peer multiaddr with /p2p/ (repeatable; the others are tried when one is down)")
    p.add_argument("--bootstrap-file", type=Path, help="file with one bootstrap multiaddr per line")


def add_compute_options(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype of the blocks this process runs (bf16: about 2x fp32's speed on CPUs)")
    if device:
        p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
        p.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                       help="hold blocks as the model's int8 or int4 variant (made on first use); the head stays")


def add_train_draft_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-train-draft", dest="train_draft", action="store_false",
                   help="do not train the model's draft head in the background while idle (on when the model "
                        "has none; DIFFUSE_TRAIN_DRAFT=0 turns it off too)")


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """A config dataclass whose fields, where not `given`, are the options of the same name."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)} | given)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def bootstrap_addrs(args: argparse.Namespace, required: bool) -> list[str]:
    """--bootstrap values plus the lines of --bootstrap-file, validated now (exit 2 if bad)."""
    from diffuse.control.bootstrap import bootstrap_list  # libp2p: only once a command runs
    return bootstrap_list(args.bootstrap, args.bootstrap_file, required)


def trio_run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """trio.run, with a DiffuseError buried in exception groups re-raised bare (so `main` prints
    `error: ...`), and Ctrl-C before the signal handler is installed exiting quietly."""
    import trio
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as eg:
        match, _ = eg.split(DiffuseError)
        if match is not None:
            raise first_leaf(match) from None
        raise
