"""Files from several peers at once over the files protocol (protocols/files.md), checked by hash.

A file (named by its SHA-256 and size, which the caller trusts: a manifest it checked) is cut
into pieces, a few per worker; a couple of workers per source take the next piece left, each on
a stream it keeps (files 1.2), and write it straight to its place in a temporary file, so memory
stays at a read or two per worker whatever the file's size; a task of its own hashes the prefix
received while the rest arrives. Which sources work at once is steered by the rate they add
(data/crew.py). A source that fails (dies, stalls, refuses) loses its workers after a few strikes
and is replaced from the reserve at once, and the bytes it did deliver stay:
its unfinished piece is asked of the others from where it stopped. A piece must be through within
max(30 s, its bytes at 1 MiB/s) (files.transfer_limit): a slower source, which a stall timer never
catches if it sends a frame now and then, is dropped for this file (not banned) and the rest of
its piece goes to the others. A BUSY source is no failure: it is asked again a second later (up to
a minute).

When every byte is in, the size is checked first (short: an interrupted transfer, nobody is
blamed), then the SHA-256. A wrong hash with one sender bans it. With several, the fetcher
finds the liar by asking again: it replaces one sender's ranges with bytes from the others and
hashes again; the sender whose replacement makes the hash right is banned (bans last for the
Fetcher's life, across files). Only a file whose hash is right gets its final name.

A fetch that ends without every byte (its sources gone, the process killed) leaves its partial
file and a note of the ranges received (`.NAME.HASH.part` and `.part.json`, the file locked while
in use); the next fetch of the same file resumes from them. Those bytes' sender is unknown then:
if the hash is wrong they are fetched again first, and nobody is banned for them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from diffuse.data.files import MIN_RATE, MIN_TRANSFER_S, STALL_TIMEOUT_S, Busy, Held, Slow, Smaller, \
    get_range, transfer_limit
from diffuse.data.crew import START_WIDTH, Crew
from diffuse.data.stream import ByteStream
from diffuse.errors import FetchError

log = logging.getLogger(__name__)
PIECE = 4 << 20  # bytes asked per request, at least
MAX_PIECE = 16 << 20  # and at most (files.MAX_RANGE, 64 MiB, is what a server must serve)
PER_SOURCE = 2  # requests in flight per source (a reference server serves 2 per peer)
STRIKES = 3  # failed requests in a row before a source is dropped for this file
BUSY_WAIT_S, BUSY_WAITS = 1.0, 60  # a BUSY source is asked again after a second, at most this often
MAX_SIZE = 1 << 40  # bytes of one file
_HEX64 = re.compile(r"[0-9a-f]{64}")
Open = Callable[[str], Awaitable[ByteStream]]  # a files stream to a peer


@dataclass
class Stats:
    """What a Fetcher moved: bytes received (bad ones too) and per source, files done."""

    received: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)
    files: int = 0


class _At:
    """Writes at an advancing offset of a file (pwrite), counting the bytes."""

    def __init__(self, fd: int, offset: int, stats: Stats, peer: str) -> None:
        self.fd, self.offset, self.count, self.stats, self.peer = fd, offset, 0, stats, peer

    def write(self, data: bytes) -> None:
        os.pwrite(self.fd, data, self.offset + self.count)
        self.count += len(data)
        self.stats.received += len(data)
        self.stats.by_peer[self.peer] = self.stats.by_peer.get(self.peer, 0) + len(data)


class _NoDigest:
    def update(self, _data: bytes) -> None:
        pass


class Fetcher:
    """Fetches files by hash from the sources each call names; `banned`: peer -> why (a peer
    that sent bytes other than the hash names)."""

    def __init__(self, open_stream: Open, *, piece: int = PIECE, per_source: int = PER_SOURCE,
                 stall_timeout: float = STALL_TIMEOUT_S, on_bytes: Callable[[int], None] | None = None,
                 min_rate: float = MIN_RATE, min_piece_s: float = MIN_TRANSFER_S) -> None:
        self.open_stream, self.piece, self.per_source = open_stream, piece, per_source
        self.min_rate, self.min_piece_s = min_rate, min_piece_s
        self.stall_timeout, self.on_bytes = stall_timeout, on_bytes
        self.banned: dict[str, str] = {}
        self.stats = Stats()
        self.spare: dict[str, list[Held]] = {}  # streams kept between files, by peer (files.Held)
        self.width, self.rates = START_WIDTH, {}  # sources at once, and each one's bytes/s (data/crew.py)

    async def fetch(self, sha256: str, size: int, dest: Path, sources: Sequence[str], what: str = "") -> Path:
        """The file with this hash and size at `dest` (atomically), from `sources`; FetchError
        names the file (`what`) and why when no honest source could give it. What an earlier
        fetch of the same file left (`.part` and its `.json`) is resumed from."""
        if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):  # part of the temporary file's name
            raise FetchError(f"{what or 'a file'}: hash {str(sha256)[:80]!r} is not 64 lowercase hex digits")
        what = what or f"file {sha256[:16]}…"
        if type(size) is not int or not 0 < size <= MAX_SIZE:
            raise FetchError(f"{what}: a size of {str(size)[:80]} bytes is not a file's (1 to {MAX_SIZE})")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp, fd = _claim(dest.with_name(f".{dest.name}.{sha256[:16]}.part"))
        notes = tmp.with_name(tmp.name + ".json")
        sent = _resumable(tmp, notes, sha256, size)  # nothing: every byte is fetched again, over what is there
        job = None  # a failure to get the rest leaves what came, for the next try; a hopeless hash, nothing
        try:
            os.ftruncate(fd, size)  # never to 0 first: ext4 then writes the whole file back as it is closed
            job = _Job(self, fd, sha256, size, what, sent, notes)
            piece = _piece(self.piece, size, len(sources) * self.per_source)
            await job.fill([(o, min(piece, e - o)) for a, e in _gaps(sent, size) for o in range(a, e, piece)], sources)
            await job.check(sources)
            os.replace(tmp, dest)
        finally:
            os.close(fd)
            if job is not None and job.hopeless:
                tmp.unlink(missing_ok=True)
                notes.unlink(missing_ok=True)
        notes.unlink(missing_ok=True)
        self.stats.files += 1
        return dest

    def lend(self, peer: str) -> Held:
        """A holder for a worker's stream to `peer`: one with a stream an earlier file left, if any."""
        spare = self.spare.get(peer)
        return spare.pop() if spare else Held()

    def give_back(self, peer: str, held: Held) -> None:
        if held.stream is not None:
            self.spare.setdefault(peer, []).append(held)

    async def close(self) -> None:
        """Close the streams kept for later files (closing the host closes them too)."""
        for spare in self.spare.values():
            for held in spare:
                await held.close()
        self.spare.clear()

    async def ban(self, peer: str, why: str) -> None:
        """Never ask `peer` again; the streams kept to it are closed."""
        if peer not in self.banned:
            log.warning("banned peer %s: %s", peer, why)
        self.banned[peer] = why
        for held in self.spare.pop(peer, []):
            await held.close()


EARLIER = ""  # the sender of bytes an earlier run left: refetched if the hash is wrong, nobody banned


def _piece(least: int, size: int, lanes: int) -> int:
    """Bytes per request: a few requests per lane, so that the hash follows the bytes closely and
    work moves between sources, each as long as may be (a request costs a round trip on a kept
    stream, a stream's set-up on a server before 1.2), between `least` and MAX_PIECE."""
    return max(least, min(MAX_PIECE, -(-size // max(2 * lanes, 1))))


def _claim(part: Path) -> tuple[Path, int]:
    """The partial file to fetch into, opened and locked: `part` (perhaps left by an earlier run),
    or a fresh name where another process is fetching into it now."""
    while True:
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return part, fd
        except BlockingIOError:
            os.close(fd)
            part = part.with_name(f"{part.name[:-5]}.{os.getpid()}-{time.monotonic_ns()}.part")


def _resumable(tmp: Path, notes: Path, sha: str, size: int) -> dict[int, tuple[int, str]]:
    """The ranges an earlier fetch of this file received, by its notes; none if they do not fit."""
    try:
        d = json.loads(notes.read_text())
        if d["sha256"] != sha or d["size"] != size or tmp.stat().st_size != size:
            return {}
        return {int(o): (int(n), EARLIER) for o, n in d["received"] if 0 <= int(o) and 0 < int(n) <= size - int(o)}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _gaps(sent: dict[int, tuple[int, str]], size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of [0, size) no entry of `sent` covers."""
    out, at = [], 0
    for o, (n, _) in sorted(sent.items()):
        if o > at:
            out.append((at, o))
        at = max(at, o + n)
    return out + ([(at, size)] if at < size else [])


class _Fill:
    """One fill of a file's ranges: the pieces left and in flight, each source's strikes, the
    workers alive per source, and the crew (data/crew.py) that says which sources work."""

    def __init__(self, job: "_Job", todo: list[tuple[int, int]], live: list[str]) -> None:
        self.job, self.f = job, job.f
        self.todo, self.busy = list(todo), []
        self.strikes, self.waits = dict.fromkeys(live, 0), dict.fromkeys(live, 0)
        self.alive: dict[str, int] = {}
        self.crew: Crew
        self.nursery: trio.Nursery
        self.steering, self.hashing = trio.CancelScope(), False  # a hash_ahead task runs

    async def hash_ahead(self) -> None:
        try:
            while await self.job.hash_ahead():
                pass
        finally:
            self.hashing = False

    async def steer(self) -> None:
        with self.steering:
            await self.crew.steer(lambda: self.f.stats.received, self.f.stats.by_peer,
                                  lambda: sum(n for _, n in self.todo))

    async def worker(self, peer: str) -> None:
        held = self.f.lend(peer)
        try:
            while (self.todo or self.busy) and self.strikes[peer] < STRIKES and peer in self.crew.working:
                if not self.todo:  # others' pieces in flight: one may come back unfinished
                    await trio.sleep(0.05)
                    continue
                await self.piece(peer, held)
                if self.strikes[peer]:
                    await trio.sleep(0.2 * self.strikes[peer])
                elif not self.hashing:  # the hash follows the bytes in a task of its own
                    self.hashing = True
                    self.nursery.start_soon(self.hash_ahead)
        finally:
            self.f.give_back(peer, held)
            self.alive[peer] -= 1
            if not any(self.alive.values()):
                self.steering.cancel()

    async def piece(self, peer: str, held: Held) -> None:
        """The next piece from `peer`; what it did not send goes back, from the byte it stopped at."""
        job = self.job
        offset, length = self.todo.pop(0)
        self.busy.append(offset)
        out, began, wait = _At(job.fd, offset, self.f.stats, peer), trio.current_time(), 0.0
        try:
            await get_range(lambda: self.f.open_stream(peer), peer, bytes.fromhex(job.sha), offset, length, job.size,
                            out, _NoDigest(), self.f.stall_timeout,
                            transfer_limit(length, self.f.min_rate, self.f.min_piece_s), held)
            self.strikes[peer] = 0
            rate = length / max(trio.current_time() - began, 1e-9)
            self.f.rates[peer] = (self.f.rates[peer] + rate) / 2 if peer in self.f.rates else rate
        except Busy as e:  # not a failure: wait, and leave the piece to whoever is free
            self.waits[peer] += 1
            self.strikes[peer] += int(self.waits[peer] >= BUSY_WAITS)  # busy for good: a failure after all
            job.errors[peer] = str(e)
            self.crew.call_up()  # one from the reserve meanwhile
            wait = BUSY_WAIT_S
        except Slow as e:  # dropped for this file, its piece's rest to the others
            log.info("%s: %s; dropped for this file", job.what, e)
            self.strikes[peer], job.errors[peer] = STRIKES, f"{e}: too slow, dropped"
        except (FetchError, Smaller) as e:  # a source's workers fail together when it dies: strikes stop at STRIKES
            self.strikes[peer] = min(self.strikes[peer] + 1, STRIKES)
            job.errors[peer] = str(e) if isinstance(e, FetchError) else "asked for a smaller range"
            log.warning("%s: %s (strike %d of %d)", job.what, job.errors[peer], self.strikes[peer], STRIKES)
        finally:
            if length > out.count:  # the rest, from where it stopped, for whoever is free
                self.todo.append((offset + out.count, length - out.count))
            if self.strikes[peer] >= STRIKES:
                self.crew.drop(peer)
            self.busy.remove(offset)
            job.received(offset, out.count, peer)
        await trio.sleep(wait)  # a BUSY source's piece is the others' meanwhile


class _Job:
    """One file: its pieces, who sent each byte range (`sent`, noted in `notes` as it grows, so a
    later run can resume), the workers."""

    def __init__(self, fetcher: Fetcher, fd: int, sha: str, size: int, what: str,
                 sent: dict[int, tuple[int, str]], notes: Path) -> None:
        self.f, self.fd, self.sha, self.size, self.what = fetcher, fd, sha, size, what
        self.sent, self.notes = sent, notes  # offset -> (length, sender)
        self.errors: dict[str, str] = {}
        self.hopeless = False  # every sender's bytes replaced and the hash still wrong: none worth keeping
        self.digest, self.hashed, self.hash_lock = hashlib.sha256(), 0, trio.Lock()  # the hash of [0, hashed)

    def note(self) -> None:
        tmp = self.notes.with_name(self.notes.name + ".tmp")
        tmp.write_text(json.dumps({"sha256": self.sha, "size": self.size,
                                   "received": [[o, n] for o, (n, _) in sorted(self.sent.items())]}))
        tmp.replace(self.notes)

    def received(self, offset: int, count: int, peer: str) -> None:
        """Note `count` bytes from `peer` at `offset` (kept for a resume) and report them."""
        if count:
            self.sent[offset] = (count, peer)
            self.note()
            if self.f.on_bytes:
                self.f.on_bytes(count)

    async def fill(self, todo: list[tuple[int, int]], sources: Sequence[str]) -> None:
        """Receive the ranges `todo` from `sources` (not banned); FetchError if some stay missing."""
        live = [p for p in dict.fromkeys(sources) if p not in self.f.banned]
        run = _Fill(self, todo, live)
        async with trio.open_nursery() as nursery:
            run.nursery = nursery

            def start(peer: str) -> None:
                for _ in range(self.f.per_source - run.alive.get(peer, 0)):
                    run.alive[peer] = run.alive.get(peer, 0) + 1
                    nursery.start_soon(run.worker, peer)

            run.crew = Crew(live, self.f.width, self.f.rates, start)
            run.crew.begin()
            if run.alive:
                nursery.start_soon(run.steer)
        self.f.width = max(1, len(run.crew.working))
        if run.todo:
            why = "; ".join(f"{p}: {e}" for p, e in self.errors.items()) or "no source offers it"
            raise FetchError(f"{self.what}: {sum(n for _, n in run.todo)} of {self.size} bytes could not be fetched "
                             f"({len(live)} source(s) tried; {why})")

    async def hash_ahead(self) -> bool:
        """Hash the bytes received in one run from the start on, while the rest still arrives (the
        check at the end then reads only what is left); False if there was nothing new."""
        async with self.hash_lock:
            end = self.hashed
            for o, (n, _) in sorted(self.sent.items()):
                if o > end:
                    break
                end = max(end, o + n)
            if end <= self.hashed:
                return False
            await trio.to_thread.run_sync(self._hash, end)  # one hop: hashlib lets go of the GIL
            return True

    def _hash(self, end: int) -> None:
        """Hash [hashed, end) of the file (in a thread), a MiB at a time into one buffer."""
        view = memoryview(bytearray(1 << 20))
        while self.hashed < end:
            n = os.preadv(self.fd, [view[:min(len(view), end - self.hashed)]], self.hashed)
            if n <= 0:
                break
            self.digest.update(view[:n])
            self.hashed += n

    async def check(self, sources: Sequence[str]) -> None:
        """Size, then hash. On a wrong hash find who lied and ban them, never an honest sender:
        first by replacing one sender's ranges at a time with the others' bytes; where that cannot
        tell (two liars can each spoil the other's replacement), by fetching the whole file from
        one source alone: a wrong hash then proves that source lied, a right one is the file, and
        every sender whose ranges differ from it is banned."""
        if os.fstat(self.fd).st_size != self.size or sum(n for n, _ in self.sent.values()) < self.size:
            raise FetchError(f"{self.what}: the transfer ended short of its {self.size} bytes")
        await self.hash_ahead()
        if self.digest.hexdigest() == self.sha:
            return
        wrong: list[dict[int, tuple[int, str, str]]] = []  # each wrong state's ranges: (length, sender, sha256)
        if not await self._replace_senders(sources, wrong):
            await self._one_alone(sources, wrong)

    async def _replace_senders(self, sources: Sequence[str], wrong: list) -> bool:
        """Replace the ranges of one sender at a time (the unproven, then the largest, first) until
        the hash is right (that sender is banned: True) or every sender was tried (False)."""
        tried: set[str] = set()
        suspect = None
        while True:
            got, ranges = await trio.to_thread.run_sync(self._digests)
            if got == self.sha:
                if suspect not in (None, EARLIER) and suspect not in self.f.banned:
                    await self.f.ban(suspect, f"sent bytes of {self.what} that others sent otherwise, "
                                              "and theirs hash right")
                return True
            wrong.append(ranges)
            everyone = {p for _, p in self.sent.values()}
            senders = sorted(everyone - tried, key=lambda p: (p != EARLIER, -sum(n for n, q in self.sent.values()
                                                                                  if q == p)))
            if not senders:
                return False
            suspect = senders[0]
            tried.add(suspect)
            if len(everyone) == 1 and suspect != EARLIER:  # it alone sent the bytes: it is the liar
                await self.f.ban(suspect, f"sent {self.what} hashing to {got[:16]}…, not {self.sha[:16]}…")
            redo = [(o, n) for o, (n, p) in self.sent.items() if p == suspect]
            for o, _ in redo:
                del self.sent[o]
            self.note()
            try:
                await self.fill(redo, [p for p in sources if p != suspect])
            except FetchError as e:
                self.hopeless = not self.sent  # what others sent stays, noted, for a later run
                raise FetchError(f"{self.what}: peer {suspect} sent bytes that hash to {got}, not {self.sha}, "
                                 f"and no other source could send them ({e})") from None

    async def _one_alone(self, sources: Sequence[str], wrong: list) -> None:
        """The whole file from one source at a time, until one's hashes right; each whose bytes do
        not is banned, and so is every earlier sender whose ranges differ from the right file."""
        piece = _piece(self.f.piece, self.size, self.f.per_source)
        for peer in [p for p in dict.fromkeys(sources) if p not in self.f.banned]:
            self.sent.clear()
            try:
                await self.fill([(o, min(piece, self.size - o)) for o in range(0, self.size, piece)], [peer])
            except FetchError as e:
                self.errors[peer] = str(e)
                continue
            got, _ = await trio.to_thread.run_sync(self._digests)
            if got != self.sha:
                await self.f.ban(peer, f"sent all of {self.what} alone, hashing to {got[:16]}…, not {self.sha[:16]}…")
                continue
            for ranges in wrong:
                for o, (n, sender, digest) in ranges.items():
                    if sender != EARLIER and sender not in self.f.banned and self._range_sha(o, n) != digest:
                        await self.f.ban(sender, f"sent bytes of {self.what} that differ from the file that hashes "
                                                 f"right (from {peer} alone)")
            return
        self.hopeless = True
        banned = ", ".join(p for p in dict.fromkeys(sources) if p in self.f.banned) or "none"
        raise FetchError(f"{self.what}: no source sent bytes that hash to {self.sha} (each sender's bytes replaced "
                         f"in turn, then each source alone; banned: {banned})")

    def _digests(self) -> tuple[str, dict[int, tuple[int, str, str]]]:
        """The file's SHA-256 and, in the same read, each received range's: (length, sender, sha256)."""
        whole, out, at = hashlib.sha256(), {}, 0
        for o, (n, sender) in sorted(self.sent.items()):
            one = hashlib.sha256()
            for chunk in self._read(o, n):
                one.update(chunk)
                if o == at:  # the ranges tile the file (else hashed whole below)
                    whole.update(chunk)
            at = o + n if o == at else -1
            out[o] = (n, sender, one.hexdigest())
        if at != self.size:
            whole = hashlib.sha256()
            for chunk in self._read(0, self.size):
                whole.update(chunk)
        return whole.hexdigest(), out

    def _range_sha(self, offset: int, length: int) -> str:
        one = hashlib.sha256()
        for chunk in self._read(offset, length):
            one.update(chunk)
        return one.hexdigest()

    def _read(self, offset: int, length: int):
        """[offset, offset + length) of the file, a MiB at a time (memory stays bounded)."""
        view = memoryview(bytearray(1 << 20))
        for at in range(offset, offset + length, len(view)):
            k = os.preadv(self.fd, [view[:min(len(view), offset + length - at)]], at)
            if k <= 0:
                return
            yield view[:k]
