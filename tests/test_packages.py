"""Models published as packages: installing them with pip when missing, assembling and checking the
file. A fake package stands in for the real one (test_gemma3 pulls that), and pip is not run."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys

import pytest

from diffuse.errors import ModelError
from diffuse.model import packages


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A PackagedModel whose module is not importable until "pip" (a stub) writes it."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "diffuse_fake_model", raising=False)  # an earlier test imported it
    data = b"GGUF and some bytes"
    model = dataclasses.replace(packages.GEMMA_3_270M, name="fake", package="diffuse-fake-model",
                                module="diffuse_fake_model", file="fake.gguf",
                                gguf_sha256=hashlib.sha256(data).hexdigest(), terms=("TERMS.txt",))
    calls: list[list[str]] = []

    def pip(cmd, **kw):
        calls.append(cmd)
        pkg = site / model.module
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / "TERMS.txt").write_text("terms")
        (pkg / "__init__.py").write_text(
            "from pathlib import Path\n"
            f"def assemble(path, overwrite=False):\n    Path(path).write_bytes({data!r})\n    return path\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(packages.subprocess, "run", pip)
    return model, calls, site


def test_install_runs_pip_in_this_interpreter_once(fake, tmp_path):
    model, calls, _ = fake
    lines: list[str] = []
    packages.install(model, lines.append)
    assert calls == [[sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                      "diffuse-fake-model==1.0.0"]]
    packages.install(model, lines.append)  # now importable: nothing to do
    assert len(calls) == 1 and lines == ["installing diffuse-fake-model==1.0.0 (and its chunk packages) with pip"]
    path = packages.assemble(model, tmp_path, lines.append)
    assert path == tmp_path / "fake.gguf" and path.read_bytes().startswith(b"GGUF")
    assert [p.name for p in packages.terms(model)] == ["TERMS.txt"]


def test_a_file_with_another_hash_is_refused(fake, tmp_path):
    model, _, _ = fake
    packages.install(model, print)
    with pytest.raises(ModelError, match="has SHA-256 .* expected 00"):
        packages.assemble(dataclasses.replace(model, gguf_sha256="00" * 32), tmp_path, print)


def test_a_failed_install_says_what_to_run(fake, monkeypatch):
    model, _, _ = fake
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for diffuse-fake-model")
    monkeypatch.setattr(packages.subprocess, "run", lambda cmd, **kw: failed)
    with pytest.raises(ModelError, match="(?s)could not install diffuse-fake-model==1.0.0: .*pip install.*No matching"):
        packages.install(model, print)
