"""Per-step commitments: Merkle roots over the exact bytes a peer sends, bound to their context.

A serving peer puts `output_commitment(...)` (32 bytes) in STEP_OK's OUTPUT_COMMITMENT. It is a
Merkle root over fixed-size chunks of the output tensor's wire bytes (little-endian, wire
dtype), hashed together with the session id, the step number, the step's input commitment and
the tensor's dtype and shape. So one commitment names one output of one step of one session:
it cannot be replayed to another step or session, and two tensors with the same bytes but
another shape or dtype do not share it. A reporter can later open any chunk - e.g. the one
holding the token a spot check flagged - with its sibling path, and anyone holding the
commitment can check that those bytes belong to that output without the whole tensor (a proof
about the peer once the peer signs its commitments; see reputation.Evidence).

The input commitment chains the steps of a session (each includes the previous one), so the
output of step n is bound to every input the session has committed up to n: what the KV cache
holds. Leaves and inner nodes are hashed with different prefixes (RFC 6962) so no inner node
can pass as a leaf; an odd node at the end of a level is promoted unchanged, and the chunk count
is bound into the commitment.

The cost grows linearly with the output's wire bytes and is small next to a step's compute, so
every step carries one; scripts/eval_integrity.py prints it
(figures: docs/measurements.md, 'Figures once quoted in module comments').
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from diffuse.data.codec import tensor_wire, wire_dtype

CHUNK_SIZE = 4096  # bytes per leaf: ~3.5 tokens of SmolLM2 in fp16; proofs stay small
DIGEST_SIZE = 32
ZERO = bytes(DIGEST_SIZE)
_LEAF, _NODE = b"\x00", b"\x01"
_OUTPUT_DOMAIN = b"diffuse/step-output/v1\x00"
_INPUT_DOMAIN = b"diffuse/step-input/v1\x00"


def _leaf(chunk: bytes | memoryview) -> bytes:
    return hashlib.sha256(_LEAF + chunk).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def _next_level(level: list[bytes]) -> list[bytes]:
    up = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
    if len(level) % 2:
        up.append(level[-1])  # promoted: its sibling path simply skips this level
    return up


def n_chunks(n_bytes: int, chunk_size: int = CHUNK_SIZE) -> int:
    return max(1, -(-n_bytes // chunk_size))


class MerkleTree:
    """A Merkle tree over `data` cut into `chunk_size`-byte chunks (the last may be shorter)."""

    def __init__(self, data: bytes | memoryview, chunk_size: int = CHUNK_SIZE):
        if chunk_size < 1:
            raise ValueError("chunk_size must be positive")
        self.data, self.chunk_size = memoryview(data).cast("B"), chunk_size
        self.n = n_chunks(len(self.data), chunk_size)
        self.levels = [[_leaf(self.chunk(i)) for i in range(self.n)]]
        while len(self.levels[-1]) > 1:
            self.levels.append(_next_level(self.levels[-1]))

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def chunk(self, i: int) -> memoryview:
        return self.data[i * self.chunk_size:(i + 1) * self.chunk_size]

    def open(self, i: int) -> "Opening":
        """Chunk i with the sibling hashes from its leaf up to the root."""
        if not 0 <= i < self.n:
            raise IndexError(f"chunk {i} of {self.n}")
        path, j = [], i
        for level in self.levels[:-1]:
            sibling = j ^ 1
            if sibling < len(level):
                path.append(level[sibling])
            j //= 2
        return Opening(i, bytes(self.chunk(i)), tuple(path))


@dataclass(frozen=True)
class Opening:
    """One chunk of a committed tensor and the sibling path that ties it to the Merkle root."""

    index: int
    chunk: bytes
    path: tuple[bytes, ...]

    def root(self, n: int) -> bytes | None:
        """The root this opening implies in a tree of n chunks; None if the path has the wrong length."""
        if not 0 <= self.index < n:
            return None
        h, j, width, path = _leaf(self.chunk), self.index, n, list(self.path)
        while width > 1:
            if j ^ 1 < width:
                if not path:
                    return None
                sib = path.pop(0)
                h = _node(sib, h) if j & 1 else _node(h, sib)
            j, width = j // 2, (width + 1) // 2
        return h if not path else None


@dataclass(frozen=True)
class StepBinding:
    """What an output commitment is about: which session, which step, which input, which tensor."""

    session_id: bytes
    step: int
    input_commitment: bytes
    header: bytes  # wire dtype code, rank, shape
    n_bytes: int
    chunk_size: int = CHUNK_SIZE

    @property
    def dtype(self) -> torch.dtype:
        return wire_dtype(self.header[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return struct.unpack(f">{self.header[1]}I", self.header[2:])

    def commit(self, root: bytes) -> bytes:
        return hashlib.sha256(
            _OUTPUT_DOMAIN + self.session_id + struct.pack(">Q", self.step) + self.input_commitment
            + self.header + struct.pack(">QI", self.n_bytes, self.chunk_size) + root).digest()

    def verify(self, commitment: bytes, opening: Opening) -> bool:
        """Whether `opening` is a chunk of the tensor this binding's `commitment` commits to."""
        n = n_chunks(self.n_bytes, self.chunk_size)
        expected = min(self.chunk_size, self.n_bytes - opening.index * self.chunk_size)
        if len(opening.chunk) != max(expected, 0):
            return False
        root = opening.root(n)
        return root is not None and self.commit(root) == commitment


def bind(session_id: bytes, step: int, input_commitment: bytes | None, t: Tensor,
         dtype: torch.dtype | None = None, chunk_size: int = CHUNK_SIZE) -> tuple[StepBinding, MerkleTree]:
    """The binding and Merkle tree of output `t` (sent in `dtype`) of one step."""
    header, raw = tensor_wire(t, dtype)
    data = memoryview(raw).cast("B")
    binding = StepBinding(session_id, step, input_commitment or ZERO, header, len(data), chunk_size)
    return binding, MerkleTree(data, chunk_size)


def output_commitment(session_id: bytes, step: int, input_commitment: bytes | None, t: Tensor,
                      dtype: torch.dtype | None = None) -> bytes:
    """The 32-byte OUTPUT_COMMITMENT of output `t` of `step` (server: before sending; client: on receipt)."""
    binding, tree = bind(session_id, step, input_commitment, t, dtype)
    return binding.commit(tree.root)


def input_commitment(session_id: bytes, step: int, previous: bytes | None, hidden: Tensor,
                     positions: Sequence[int], cache_len: int, keep: Sequence[int] = (),
                     mask: Tensor | None = None, commit: bool = True,
                     dtype: torch.dtype | None = None) -> bytes:
    """The 32-byte INPUT_COMMITMENT of a STEP: everything that, with the earlier steps, fixes the output.

    `previous` is the input commitment of the session's previous step (None for the first), so
    the chain commits to the whole history the KV cache was built from. Client and server both
    compute it from the STEP they sent / received; the server binds its own value, never the
    client's claim, into its output commitment (a client could otherwise frame a peer by
    claiming an input it did not send).
    """
    fields = struct.pack(f">QI{len(positions)}iQI{len(keep)}IB", step, len(positions), *positions,
                         cache_len, len(keep), *keep, commit)
    m = b"" if mask is None else bytes(mask.detach().cpu().bool().flatten().numpy().tobytes())
    header, raw = tensor_wire(hidden, dtype)
    root = MerkleTree(raw).root
    return hashlib.sha256(_INPUT_DOMAIN + session_id + (previous or ZERO) + fields
                          + struct.pack(">I", len(m)) + m + header + root).digest()


def chunks_of_token(shape: Sequence[int], dtype: torch.dtype, row: int, token: int,
                    chunk_size: int = CHUNK_SIZE) -> range:
    """Indices of the chunks holding hidden[row, token, :] of a [B, T, H] tensor: what to open."""
    _, t, h = shape
    item = torch.tensor([], dtype=dtype).element_size()
    first = (row * t + token) * h * item
    return range(first // chunk_size, (first + h * item - 1) // chunk_size + 1)
