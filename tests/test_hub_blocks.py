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
