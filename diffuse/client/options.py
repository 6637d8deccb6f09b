"""The client service's config from a client's options, which `ask`, `api` and the daemon share:
the command line resolves the swarm (its bootstrap peers, key and discovery) and hands the rest
over as a mapping of option names to values; what they mean together is decided here."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffuse.client.service import ServiceConfig
from diffuse.client.swarm import SwarmOptions
from diffuse.client.swarm_backend import SwarmConfig, trust_options
from diffuse.client.vault import for_answers
from diffuse.control.modes import SwarmAccess
from diffuse.errors import DiffuseError
from diffuse.model.load import parse_dtype

log = logging.getLogger(__name__)


def parse_local_blocks(text: str) -> tuple[int, int]:
    try:
        front, back = (int(x) for x in text.split(","))
        if front < 0 or back < 0:
            raise ValueError
        return front, back
    except ValueError:
        raise DiffuseError(f"--local-blocks wants N,M with N, M >= 0, got {text!r}") from None


def fetch_for_client(options: Mapping[str, Any], home: Path, models: tuple[str | None, ...], boot: Sequence[str],
                     access: SwarmAccess, mdns: bool) -> tuple[str, ...]:
    """`ask / api --from-swarm`: what the client holds of each model (client/from_swarm.py), fetched
    by this process into the store; the store names to serve them by. `ask` and `api` call it
    before they ask a daemon, which then serves those names as any stored model (or declines:
    this process serves them)."""
    from diffuse.client.from_swarm import for_client

    judging = (options["trust"] or access.trust) != "off"
    config = SwarmConfig(tuple(boot), access, mdns=mdns).node_config()
    return tuple(for_client(home, dict(options) | {"model": m}, config, judging, log.warning) for m in models)


def service_config(options: Mapping[str, Any], home: Path, models: tuple[str | None, ...], boot: Sequence[str],
                   access: SwarmAccess | None, mdns: bool, *, fallback_from_store: bool, speculate: bool | None,
                   warm_up: bool = False) -> ServiceConfig:
    """Whole models in this process where `access` is None (--local), else through that swarm."""
    swarm, exact = None, options.get("exact", False)
    if access is not None and options.get("from_swarm"):  # what a client holds, from the peers first
        models = fetch_for_client(options, home, models, boot, access, mdns)
    if access is not None:
        trust = options["trust"] or access.trust  # --trust, or the swarm mode's own form of the trust plane
        if options["step_timeout"] <= 0 or options["route_wait"] < 0:
            raise DiffuseError("--step-timeout must be positive and --route-wait not negative")
        given = {f.name: options[f.name] for f in dataclasses.fields(SwarmOptions) if f.name in options}
        swarm_options = SwarmOptions(**given | {
            "local_blocks": parse_local_blocks(options["local_blocks"]), "exact": exact,
            "dtype": parse_dtype(options["dtype"]), "wire_dtype": parse_dtype(options["wire_dtype"]),
            "trust": trust_options(trust, options.get("audit_rate"))})
        swarm = SwarmConfig(tuple(boot), access, swarm_options, mdns=mdns, hole_punch=options["hole_punch"],
                            wait=options["wait"], trust=trust, credit=options["credit"])
    return ServiceConfig(home, models, swarm, options["fallback"], fallback_from_store, speculate, exact,
                         options["dtype"], options["device"], warm_up, vault=for_answers(home, options["history"]),
                         quant=options.get("quant", "none"))
