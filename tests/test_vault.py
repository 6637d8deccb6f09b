"""The history vault (client/vault.py): sealed records, a wrong passphrase refused without a
change, a damaged record named while the others read; `diffuse history`, `ask --history` and
`api --history` (with OpenAI's `store: false` and the dialects' `x-diffuse-store: false`) through
real processes."""

from __future__ import annotations

import base64
import io
import json
import stat
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from nacl import pwhash

from support.procs import DIFFUSE, Procs, start_server, stop_server
from diffuse.client import vault
from diffuse.client.vault import PASSPHRASE_ENV, Damaged, VaultError
from diffuse.home import DEFAULT_MODEL

PASSPHRASE = "correct horse battery staple"
QUESTION = "What is the capital of France? Reply with the city name."
CHEAP = {"opslimit": pwhash.argon2id.OPSLIMIT_MIN, "memlimit": pwhash.argon2id.MEMLIMIT_MIN}  # in-process tests only


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def _encodings(text: str) -> list[bytes]:
    """`text` as it could show in a file: UTF-8, UTF-16 either way, and base64 at each of the three
    alignments (the groups that depend on `text` alone; only for long texts, as the header is
    base64 and a short group could turn up in it by chance)."""
    raw = text.encode()
    shifted = [base64.b64encode(bytes(k) + raw) for k in range(3)] if len(raw) >= 16 else []
    return [raw, text.encode("utf-16-le"), text.encode("utf-16-be")] + \
        [b64[4 if k else 0:-4] for k, b64 in enumerate(shifted)]


def _leaks(directory: Path, texts: list[str]) -> list[tuple[str, str]]:
    """Each (file, piece) where a text, or a word of it of five letters or more, shows in a file."""
    pieces = set(texts) | {w.strip(".,?!") for t in texts for w in t.split() if len(w.strip(".,?!")) >= 5}
    return [(p.name, piece) for p in directory.iterdir() for piece in pieces
            if any(e and e in p.read_bytes() for e in _encodings(piece) + _encodings(piece.lower()))]


def test_records_are_sealed_and_read_back(tmp_path):
    directory = tmp_path / "history"
    v = vault.create(directory, PASSPHRASE, **CHEAP)
    messages = [{"role": "user", "content": "Quelle est la capitale de la France ? Réponds vite."}]
    ident = v.keep(messages, ["Paris, évidemment."], "some-model")
    record = v.read(ident)
    assert (record.id, record.messages, record.answers, record.model) == (ident, messages, ["Paris, évidemment."],
                                                                          "some-model")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in directory.iterdir())
    assert not _leaks(directory, [messages[0]["content"], "Paris, évidemment."])
    assert ((directory / f"{ident}.rec").stat().st_size - vault.NONCE - 16) % vault.PAD == 0  # padded
    assert not list(directory.glob(".*.tmp"))  # the atomic write left no temporary file
    again = vault.Vault(directory, vault.header(directory).key(PASSPHRASE))
    assert again.records() == ([record], [])
    assert [r.id for r in again.records()[0] if r.mentions("CAPITALE")] == [ident]


def test_wrong_passphrase_changes_nothing(tmp_path, monkeypatch):
    directory = tmp_path / "history"
    vault.create(directory, PASSPHRASE, **CHEAP).keep([{"role": "user", "content": "hi"}], ["hello"], "m")
    before = _snapshot(directory)
    monkeypatch.setenv(PASSPHRASE_ENV, "not the passphrase")
    with pytest.raises(VaultError, match="wrong passphrase"):
        vault.unlock(directory)
    assert _snapshot(directory) == before


def test_a_damaged_record_is_named_and_the_others_read(tmp_path):
    directory = tmp_path / "history"
    v = vault.create(directory, PASSPHRASE, **CHEAP)
    ids = [v.keep([{"role": "user", "content": f"question {i}"}], [f"answer {i}"], "m") for i in range(3)]
    path = directory / f"{ids[1]}.rec"
    blob = bytearray(path.read_bytes())
    blob[40] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(Damaged, match=ids[1]):
        v.read(ids[1])
    good, damaged = v.records()
    assert damaged == [ids[1]] and sorted(r.id for r in good) == sorted([ids[0], ids[2]])


def test_a_record_renamed_to_another_id_does_not_open(tmp_path):
    directory = tmp_path / "history"
    v = vault.create(directory, PASSPHRASE, **CHEAP)
    ident = v.keep([{"role": "user", "content": "hi"}], ["hello"], "m")
    (directory / f"{ident}.rec").rename(directory / "0123456789ab.rec")
    assert v.records() == ([], ["0123456789ab"])


def test_damaged_header_and_missing_vault_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv(PASSPHRASE_ENV, PASSPHRASE)
    with pytest.raises(VaultError, match="history init"):
        vault.unlock(tmp_path / "none")
    directory = tmp_path / "history"
    vault.create(directory, PASSPHRASE, **CHEAP)
    (directory / vault.HEADER).write_text(json.dumps({"format": "diffuse-history", "version": 1}))
    with pytest.raises(VaultError, match="header .* is damaged"):
        vault.unlock(directory)
    (directory / vault.HEADER).write_text(json.dumps({"version": 9}))
    with pytest.raises(VaultError, match="version 9"):
        vault.unlock(directory)


def test_when_answers_are_kept(tmp_path, monkeypatch):
    """ask: by default where a vault exists, `--history` demands one, `--ephemeral` never; api: only
    with `--history` (False otherwise)."""
    monkeypatch.setenv(PASSPHRASE_ENV, PASSPHRASE)
    assert vault.for_answers(tmp_path, None) is None and vault.for_answers(tmp_path, False) is None
    with pytest.raises(VaultError, match="history init"):
        vault.for_answers(tmp_path, True)
    vault.create(vault.directory_of(tmp_path), PASSPHRASE, **CHEAP)
    assert vault.for_answers(tmp_path, False) is None
    assert vault.for_answers(tmp_path, None).directory == vault.for_answers(tmp_path, True).directory


class FakeKeyring:
    priority = 1
    name = "fake"

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, user: str) -> str | None:
        return self.kept.get((service, user))

    def set_password(self, service: str, user: str, secret: str) -> None:
        self.kept[service, user] = secret

    def delete_password(self, service: str, user: str) -> None:
        del self.kept[service, user]


def test_the_os_keyring_keeps_the_key(tmp_path, monkeypatch):
    ring = FakeKeyring()
    monkeypatch.setattr(vault, "_keyring", lambda: ring)
    monkeypatch.setenv(PASSPHRASE_ENV, PASSPHRASE)
    directory = tmp_path / "history"
    assert "OS keyring (fake)" in vault.init(directory)
    monkeypatch.delenv(PASSPHRASE_ENV)
    monkeypatch.setattr("sys.stdin", io.StringIO())  # no terminal to ask on: only the keyring can unlock it
    ident = vault.unlock(directory).keep([{"role": "user", "content": "hi"}], ["hello"], "m")
    assert vault.unlock(directory).read(ident).answers == ["hello"]
    ring.kept[vault.KEYRING_SERVICE, str(directory)] = bytes(32).hex()  # a stale key is no key
    with pytest.raises(VaultError, match=PASSPHRASE_ENV):
        vault.unlock(directory)
    vault.wipe(directory)
    assert not directory.exists() and ring.kept == {}


@pytest.fixture(scope="module")
def vault_home(home, tmp_path_factory) -> Path:
    """A home of its own (a vault in the shared one would change every other test's `ask`), with
    the shared store's models."""
    mine = tmp_path_factory.mktemp("vault-home")
    (mine / "models").symlink_to(home / "models")
    return mine


@pytest.mark.slow
def test_history_through_the_cli(vault_home):
    with Procs(vault_home) as procs:
        procs.env |= {PASSPHRASE_ENV: PASSPHRASE, "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
        run = procs.run
        assert run("history", "init").returncode == 0
        directory = vault_home / "history"
        asked = run("ask", "--local", "--history", "--max-tokens", "12", QUESTION, timeout=300)
        assert asked.returncode == 0, asked.stderr
        answer = asked.stdout.strip()
        assert "Paris" in answer
        assert run("ask", "--local", "--ephemeral", "--max-tokens", "4", "Say nothing else.", timeout=300) \
            .returncode == 0
        kept = sorted(p.stem for p in directory.glob("*.rec"))
        assert len(kept) == 1, "the ephemeral question was kept"
        assert not _leaks(directory, [QUESTION, answer])

        found = run("history", "search", "capital OF france")
        assert found.returncode == 0 and found.stdout.startswith(kept[0]), found
        shown = run("history", "show", kept[0]).stdout
        assert QUESTION in shown and answer in shown

        before = _snapshot(directory)
        wrong = subprocess.run(DIFFUSE + ["history", "search", "capital"], capture_output=True, text=True,
                               env=procs.env | {PASSPHRASE_ENV: "wrong"}, timeout=60)
        assert wrong.returncode == 2 and "wrong passphrase" in wrong.stderr and not wrong.stdout
        assert _snapshot(directory) == before

        _cli_damage_rm_export_wipe(procs, directory, kept[0])


def _cli_damage_rm_export_wipe(procs: Procs, directory: Path, first: str) -> None:
    second = vault.Vault(directory, vault.header(directory).key(PASSPHRASE)).keep(
        [{"role": "user", "content": "second"}], ["kept"], "m")
    path = directory / f"{first}.rec"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x80
    path.write_bytes(bytes(blob))
    listed = procs.run("history", "list")
    assert listed.returncode == 1 and f"record {first} is damaged" in listed.stderr
    assert listed.stdout.startswith(second)
    exported = procs.run("history", "export")
    assert [r["id"] for r in json.loads(exported.stdout)] == [second] and first in exported.stderr
    assert procs.run("history", "rm", first).returncode == 0
    assert procs.run("history", "list").stdout.split()[:1] == [second]
    assert procs.run("history", "rm", first).returncode == 2
    refused = procs.run("history", "wipe")
    assert refused.returncode == 2 and "--yes" in refused.stderr and directory.exists()
    assert procs.run("history", "wipe", "--yes").returncode == 0 and not directory.exists()


@pytest.mark.slow
def test_api_keeps_only_what_a_request_lets_it(vault_home, tmp_path, monkeypatch):
    monkeypatch.setenv(PASSPHRASE_ENV, PASSPHRASE)
    directory = vault_home / "history"
    if not directory.exists():
        vault.create(directory, PASSPHRASE)
    v = vault.unlock(directory)
    known = set(v.ids())
    proc, url = start_server([*DIFFUSE, "--home", str(vault_home), "api", "--local", "--history", "--listen",
                              "127.0.0.1:0", "--max-tokens", "8"], tmp_path / "api.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for text, store in (("Kept question about tulips", None), ("Unkept question about roses", False)):
            extra = {} if store is None else {"store": store}
            client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": text}],
                                           max_tokens=8, **extra)
        for path, body in (("/api/chat", {"model": DEFAULT_MODEL, "stream": False, "messages": [
                {"role": "user", "content": "Unkept Ollama question"}]}),
                ("/v1/messages", {"model": DEFAULT_MODEL, "max_tokens": 8, "messages": [
                    {"role": "user", "content": "Unkept Anthropic question"}]})):
            r = httpx.post(url + path, json=body, headers={"x-diffuse-store": "false"}, timeout=120)
            assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/messages", json={"model": DEFAULT_MODEL, "max_tokens": 8, "messages": [
            {"role": "user", "content": "Kept Anthropic question"}]}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        stop_server(proc)
    new = [v.read(i) for i in set(v.ids()) - known]
    asked = sorted(r.messages[-1]["content"] for r in new)
    assert asked == ["Kept Anthropic question", "Kept question about tulips"]
    assert all(r.model == DEFAULT_MODEL and r.answers[0] for r in new)
