"""diffuse.control.upstream: every adaptation of py-libp2p is checked at start-up, and an upgrade
that moves any name it relies on fails loudly, naming it, before a host is built."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from diffuse.control import upstream
from diffuse.control.host import make_host
from diffuse.control.identity import ephemeral

DOC = Path(__file__).resolve().parent.parent / "docs" / "libp2p.md"


def test_the_installed_py_libp2p_is_the_one_the_adaptations_were_written_for():
    assert upstream.problems() == []


def test_another_version_refuses_to_build_a_host(monkeypatch):
    monkeypatch.setattr(upstream.metadata, "version", lambda name: "0.9.0")
    monkeypatch.setattr(upstream, "_checked", False)
    with pytest.raises(upstream.UpstreamChanged, match=r"py-libp2p 0\.9\.0 is installed, not 0\.8\.1"):
        make_host(ephemeral())


def test_a_private_method_gone_upstream_is_named(monkeypatch):
    monkeypatch.delattr(DCUtRProtocol, "_try_unilateral_upgrade")
    found = upstream.problems()
    assert found == ["libp2p.relay.circuit_v2.dcutr:DCUtRProtocol._try_unilateral_upgrade is gone "
                     "(nat.Punch, docs/libp2p.md#dcutr-private-wait)"]


def test_an_instance_attribute_no_longer_set_is_named(monkeypatch):
    init = DCUtRProtocol.__init__

    def renamed(self, host):  # the same behaviour, with `_in_progress` under another name
        init(self, host)
    monkeypatch.setattr(DCUtRProtocol, "__init__", renamed)
    assert any("DCUtRProtocol._in_progress is gone" in p for p in upstream.problems())


def test_an_overridden_method_whose_parameters_changed_is_named(monkeypatch):
    async def _try_dial(self, peer_id, addrs, timeout):
        return None
    monkeypatch.setattr(AutoNATService, "_try_dial", _try_dial)
    assert upstream.problems() == []  # a parameter added at the end: our override's call still fits

    async def renamed(self, peer, addresses):
        return None
    monkeypatch.setattr(AutoNATService, "_try_dial", renamed)
    assert upstream.problems() == ["libp2p.host.autonat.autonat:AutoNATService._try_dial now takes "
                                   "('self', 'peer', 'addresses'), not ('self', 'peer_id', 'addrs') (nat.DialBack)"]


def test_each_adaptation_names_code_of_ours_and_a_written_up_defect():
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', DOC.read_text()))
    for a in upstream.ADAPTATIONS:
        module, _, attr = a.by.partition(".")
        ours = importlib.import_module(f"diffuse.control.{module}")
        assert not attr or hasattr(ours, attr), a.by
        assert a.defect in anchors, f"docs/libp2p.md lacks #{a.defect}"


def test_eleven_process_global_patches():
    patched = {(a.owner, name) for a in upstream.ADAPTATIONS if a.kind == upstream.PATCH for name in a.names}
    assert len(patched) == 11
