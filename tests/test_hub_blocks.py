"""`diffuse model pull ORG/NAME --blocks A:B` against a local HTTP server standing in for the Hub
(HF_ENDPOINT): a 3-shard tiny model; the server's log shows only the shards holding the span
requested, the store lists the model as partial, its blocks load and check against the manifest,
and a later pull of more blocks requests only the shard it lacks."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from safetensors.torch import save_file

from support.procs import DIFFUSE
from tiny import make_tiny
from diffuse.home import models_dir
from diffuse.model.load import load_span
from diffuse.model.weights import ModelFiles, block_hash, load_manifest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHARDS = {0: "model-00001-of-00003.safetensors", 1: "model-00001-of-00003.safetensors",
          2: "model-00002-of-00003.safetensors", 3: "model-00003-of-00003.safetensors"}


@pytest.fixture
def hub(tmp_path):
    """A repo org/tiny of 3 shards (blocks 0-1 with the embeddings, block 2, block 3 with the
    norm and LM head) behind a Hub-like HTTP server; yields (its URL, its request log, the model)."""
    model = make_tiny(tmp_path / "tiny")
    tensors = ModelFiles(model)
    files: dict[str, bytes] = {n: (model / n).read_bytes() for n in ("config.json", "tokenizer.json")
                               if (model / n).is_file()}
    where = {}
    for name in tensors.where:
        block = int(name.split(".")[2]) if name.startswith("model.layers.") else (0 if "embed" in name else 3)
        where[name] = SHARDS[block]
    for shard in sorted(set(SHARDS.values())):
        path = tmp_path / shard
        save_file({n: t.contiguous() for n, t in tensors.read([n for n, s in where.items() if s == shard]).items()},
                  path)
        files[shard] = path.read_bytes()
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": where}).encode()
    log: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self.answer(False)

        def do_GET(self) -> None:
            self.answer(True)

        def answer(self, body: bool) -> None:
            parts = self.path.split("?")[0].split("/")
            if parts[1] == "api":  # the repo's revision, then its file tree
                data = json.dumps([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                   for f, d in files.items()] if "tree" in parts else
                                  {"id": "org/tiny", "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
                data, headers = data.encode(), {"Content-Type": "application/json"}
            else:
                name = "/".join(parts[5:])
                log.append(f"{self.command} {name}")
                if name not in files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files[name]
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log, model
    finally:
        server.shutdown()


def pull(url: str, home, blocks: str) -> subprocess.CompletedProcess:
    env = os.environ | {"DIFFUSE_HOME": str(home), "HF_ENDPOINT": url, "HF_HUB_CACHE": str(home / "hf-cache")}
    out = subprocess.run([*DIFFUSE, "model", "pull", "org/tiny", "--blocks", blocks], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_only_the_shards_of_the_span_are_pulled(hub, tmp_path):
    url, log, original = hub
    home = tmp_path / "home"
    pull(url, home, "2:4")
    shards = {line.split(" ", 1)[1] for line in log if line.endswith(".safetensors")}
    assert shards == {SHARDS[2], SHARDS[3]}, log  # never the first shard
    dest = models_dir(home) / "tiny"
    assert {p.name for p in dest.glob("*.safetensors")} == {SHARDS[2], SHARDS[3]}
    manifest, whole = load_manifest(dest), load_manifest(original)
    assert manifest.block_hashes == ["", ""] + whole.block_hashes[2:]
    load_span(dest, 2, 4)  # checks every block against the manifest as it loads
    listing = subprocess.run([*DIFFUSE, "model", "list"], capture_output=True, text=True, timeout=120,
                             env=os.environ | {"DIFFUSE_HOME": str(home)})
    assert "partial: holds blocks 2-3 of 4" in listing.stdout, listing
    log.clear()
    pull(url, home, "0:2")  # the rest: only the shard it lacks
    assert {line.split(" ", 1)[1] for line in log if line.endswith(".safetensors")} == {SHARDS[0]}, log
    assert load_manifest(dest).model_hash == whole.model_hash  # every block and the head now: the model's own
    assert block_hash(ModelFiles(dest).read_block(0)) == whole.block_hashes[0]


def fetch_from_peers(original, dest, blocks: list[int], head: bool) -> list[str]:
    """What `--from-swarm` does to store `dest` for `blocks` (and the head), its manifest the
    swarm's (format 2) taking the place of a partial one of the Hub's where they agree; the
    transfers stubbed by the original's canonical bytes. Returns what it fetched."""
    import shutil

    import trio

    from diffuse.client import from_swarm
    from diffuse.client.manifests import BLOCK_FILES, MANIFEST_SHA
    from diffuse.control.records import PeerRecord
    from diffuse.model import blockfiles
    from test_fetcher import write_canonical

    swarm = blockfiles.complete(original)  # the source's manifest, as it announces it
    if not (dest / "manifest.json").is_file() or from_swarm._partial_of(load_manifest(dest), swarm, dest):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(original / "manifest.json", dest / "manifest.json")
    files, asked = ModelFiles(original), []
    record = PeerRecord("SRC", swarm.model_id, 4, 0, 4, tuple(swarm.block_hashes), "float32", 1.0, 100, (), 0.0,
                        1e12, 0.0, extra={BLOCK_FILES: True, MANIFEST_SHA: "0" * 64})

    class Fetcher:
        async def fetch(self, sha, size, path, sources, what):
            asked.append(what)
            listed = {h: name for name, (_, h) in swarm.files.items()}
            if sha in listed:
                path.write_bytes((original / listed[sha]).read_bytes())
                return path
            write_canonical(files, None if sha == swarm.head_hash else swarm.block_hashes.index(sha), path)
            assert path.stat().st_size == size
            return path

    async def main():
        await from_swarm._files(Fetcher(), dest, swarm, ["SRC"])
        await from_swarm._blocks(Fetcher(), dest, swarm, [record], blocks, head, from_swarm.Progress(lambda text: None))

    trio.run(main)
    return [x for x in asked if "block" in x or "head" in x]


def listed(home) -> str:
    out = subprocess.run([*DIFFUSE, "model", "list"], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"DIFFUSE_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_hub_shards_and_blocks_from_peers_combine_in_one_store(hub, tmp_path):
    """A store pulled from the Hub for blocks 2-3 then needs blocks 0-3 and the head from peers:
    it fetches only blocks 0, 1 and the head; one that fetched blocks 0-1 from peers then pulls
    0:4 from the Hub: only the shards of blocks 2 and 3. Either way `model list` and `model
    verify` see every file, and the blocks load against the swarm's manifest, which stays."""
    from dataclasses import replace

    from diffuse.client import from_swarm
    from diffuse.errors import DiffuseError
    from diffuse.model import blockfiles
    from diffuse.model.load import load_span

    url, log, original = hub
    home = tmp_path / "home"
    pull(url, home, "2:4")
    dest = models_dir(home) / "tiny"
    partial, swarm = load_manifest(dest), blockfiles.complete(original)
    with pytest.raises(DiffuseError, match="is another model"):  # a hash it holds differs: never mixed
        from_swarm._partial_of(replace(partial, block_hashes=partial.block_hashes[:3] + ["f" * 64]), swarm, dest)
    asked = fetch_from_peers(original, dest, [0, 1, 2, 3], head=True)
    assert asked == ["block 0 of tiny", "block 1 of tiny", "tiny's head"], asked
    assert {p.name for p in dest.glob("*.safetensors")} == {SHARDS[2], SHARDS[3], "block-00000.safetensors",
                                                             "block-00001.safetensors", "head.safetensors"}
    assert load_manifest(dest) == load_manifest(original) and blockfiles.held(dest) == ({0, 1, 2, 3}, True)
    assert "partial" not in listed(home) and blockfiles.verify(dest, print) == 0
    load_span(dest, 0, 4)

    other = tmp_path / "other"
    dest = models_dir(other) / "tiny"
    assert fetch_from_peers(original, dest, [0, 1], head=False) == ["block 0 of tiny", "block 1 of tiny"]
    manifest = (dest / "manifest.json").read_bytes()
    log.clear()
    pull(url, other, "0:4")
    assert {line.split(" ", 1)[1] for line in log if line.endswith(".safetensors")} == {SHARDS[2], SHARDS[3]}, log
    assert (dest / "manifest.json").read_bytes() == manifest  # the swarm's, kept
    assert "partial: holds blocks 0-3 of 4" in listed(other)  # the embeddings lie in the shard not pulled
    assert blockfiles.verify(dest, print) == 0
    load_span(dest, 0, 4)
