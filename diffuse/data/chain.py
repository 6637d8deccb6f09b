"""A chained hop's link to the next peer of its route (protocols 1.2-1.3, protocols/inference.md section 13).

A client that opens a session with CHAIN_TO_RECORD names where the hop's outputs go: the next
hop's peer, the session the client opened there (which in turn names this peer in CHAIN_FROM) and
that peer's signed record. The hop dials only the addresses that record signs (`signed_addrs`):
a client cannot make peers dial where it likes (a dial amplifier, or a probe into a peer's LAN).
While the session opens, the hop dials that peer (Noise, the same protocol id),
sends ATTACH for that session and waits for ATTACH_OK: whether the link works is known before
OPEN_OK, so a hop that cannot reach the next one answers without the CHAINED flag and its outputs
return through the client for the whole session (no step ever waits on a link that never worked).
Each output is then written to the link as a STEP of the downstream session (same step number,
positions, keep, cache_len, mask and flags as the STEP it answers) before the client's copy
goes out. A link that fails is dropped at once and the client is told in that step's STEP_OK
(LINK_ERROR); the peer never forwards anywhere but the peer the client named.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from diffuse.control.records import InvalidRecord, check_time, verify
from diffuse.data.codec import Attach, AttachOk, Downstream, ErrorMsg, FrameDecoder, Step, encode
from diffuse.data.stream import READ_CHUNK, ByteStream, close_quietly

log = logging.getLogger(__name__)
LINK_OPEN_S = 5.0  # dial + ATTACH: below what a chained OPEN adds to the client's OPEN deadline
LINK_WRITE_S = 2.0  # a forwarded frame the next peer does not take in this long, plus LINK_WRITE_RATE, drops the link
LINK_WRITE_RATE = 1_000_000  # bytes/s a forwarded frame may take on top of LINK_WRITE_S (a prefill's frame is large)
UNREACHABLE = "cannot reach the next peer"  # all the client learns of a failed dial: no port-scan oracle


def link_write_s(nbytes: int) -> float:
    """Seconds a forwarded frame of `nbytes` may take to write; the client's step deadline of a
    chained hop adds the same."""
    return LINK_WRITE_S + nbytes / LINK_WRITE_RATE

DialPeer = Callable[[str, tuple[str, ...]], Awaitable[ByteStream]]
SignedAddrs = Callable[[Downstream], tuple[str, ...]]


class BadChainTarget(ValueError):
    """CHAIN_TO_RECORD names a next peer its record does not prove: the hop dials nothing."""


def signed_addrs(downstream: Downstream, now: float | None = None) -> tuple[str, ...]:
    """The addresses `downstream`'s record signs, once the signature is the named peer's own and
    the record is fresh and online; BadChainTarget naming the problem otherwise. (An open
    connection to that peer is reused: no dial at all, control/dial.py.)"""
    try:
        rec = verify(downstream.record, downstream.signature).record
        check_time(rec, now)
    except InvalidRecord as e:
        raise BadChainTarget(f"the next peer's record is refused: {e}") from None
    if rec.peer_id != downstream.peer_id:
        raise BadChainTarget(f"the record names peer {rec.peer_id}, not the next peer {downstream.peer_id}")
    if not rec.online or not rec.addrs:
        raise BadChainTarget(f"the record of {rec.peer_id} is withdrawn or announces no address")
    return rec.addrs


class Link:
    """The stream a hop forwards its outputs on; `error` says why it was dropped (None while up)."""

    def __init__(self, downstream: Downstream, stream: ByteStream, nursery: trio.Nursery):
        self.downstream, self.stream = downstream, stream
        self.nursery = nursery  # the session's: the link's watcher, writes and closing run there
        self.error: str | None = None
        self.forwarded = 0
        nursery.start_soon(self.watch)

    async def forward(self, step: Step) -> bool:
        """Write one output as a STEP of the downstream session; False (and `error`) if the link is
        gone. Never raises: the client's copy still has to go out.

        The write runs in a task of its own and is waited for at most link_write_s: a message,
        once begun, is written whole (control/whole_writes.py), so a link whose packets are
        dropped would otherwise hold the client's copy until the connection's write timeout,
        and the client would blame this peer for its link."""
        if self.error is not None:
            return False
        try:
            frame = encode(step)
        except Exception as e:  # noqa: BLE001 - an output the codec refuses
            return await self.drop(f"forwarding failed: {type(e).__name__}: {e}")
        limit, done, failed = link_write_s(len(frame)), trio.Event(), []

        async def write() -> None:
            try:
                await self.stream.write(frame)
            except Exception as e:  # noqa: BLE001 - py-libp2p's many ways of a stream ending
                failed.append(f"forwarding failed: {type(e).__name__}: {e}")
            finally:
                done.set()

        self.nursery.start_soon(write)
        with trio.move_on_after(limit):
            await done.wait()
        if failed or not done.is_set():
            return await self.drop(failed[0] if failed else f"the next peer did not take a frame in {limit:.1f} s")
        self.forwarded += 1
        return True

    async def drop(self, why: str) -> bool:
        """Stop forwarding; the stream is closed beside the session (closing writes too, and a
        link that takes no bytes would hold the step)."""
        if self.error is None:
            self.error = why
            log.info("link to %s dropped: %s", self.downstream.peer_id, why)
            self.nursery.start_soon(close_quietly, self.stream)
        return False

    async def watch(self) -> None:
        """Read what the next peer says on the link (only ERROR, when it refuses a frame or its
        session ends): the link is dropped then, and the next STEP_OK tells the client."""
        dec = FrameDecoder()
        while self.error is None:
            try:
                data = await self.stream.read(READ_CHUNK)
                msgs = dec.feed(data) if data else None
            except Exception as e:  # noqa: BLE001 - a reset or garbage (WireError): the link is gone
                await self.drop(f"link failed: {type(e).__name__}: {e}")
                return
            if msgs is None:
                await self.drop("the next peer closed the link")
                return
            for m in msgs:
                if isinstance(m, ErrorMsg):
                    await self.drop(f"the next peer refused: {m.message}")
                    return

    async def close(self) -> None:
        self.error = self.error or "session ended"
        await close_quietly(self.stream)


async def open_link(dial: DialPeer | None, downstream: Downstream, nursery: trio.Nursery,
                    addrs_of: SignedAddrs = signed_addrs) -> tuple[Link | None, str | None]:
    """A link to `downstream` at the addresses `addrs_of` allows, attached to its session, or
    None and why not (within LINK_OPEN_S); its tasks run in `nursery`, the session's."""
    if dial is None:
        return None, "this peer does not forward (no host to dial from)"
    try:
        addrs = addrs_of(downstream)
    except BadChainTarget as e:
        log.info("not linking to %s: %s", downstream.peer_id, e)
        return None, f"not dialled: {e}"
    stream = None
    try:
        with trio.fail_after(LINK_OPEN_S):
            stream = await dial(downstream.peer_id, addrs)
            await stream.write(encode(Attach(downstream.session_id)))
            dec, got = FrameDecoder(), []
            while not got:
                data = await stream.read(READ_CHUNK)
                if not data:
                    raise EOFError("the next peer closed the stream")
                got = dec.feed(data)
    except trio.TooSlowError:
        why = f"no link to the next peer in {LINK_OPEN_S:g} s"
    except Exception as e:  # noqa: BLE001 - unreachable (NAT, firewall), a peer speaking 1.1, a refusal
        log.info("no link to %s: %s: %s", downstream.peer_id, type(e).__name__, e)  # the detail stays here
        why = UNREACHABLE
    else:
        if isinstance(got[0], AttachOk) and got[0].session_id == downstream.session_id:
            log.info("linked to %s for its session %s", downstream.peer_id, downstream.session_id.hex()[:8])
            return Link(downstream, stream, nursery), None
        why = f"the next peer refused the link: {getattr(got[0], 'message', type(got[0]).__name__)}"
    if stream is not None:
        await close_quietly(stream)
    return None, why
