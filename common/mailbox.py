"""Shared-memory mailboxes for the local-socket Speculate stream (common/frames.py).

Two processes on one host that both spin on their event loops can hand each other a
message through memory instead of a socket: no system call, no event-loop wake-up.
On a CPU VM a round trip took 3-15 us against 130-190 us through a Unix socket read
by event loops (bench/hop_probe.py). The socket connection stays: it carries the
hello, errors, messages too large for a slot, and a wake-up frame for a side that is
not spinning.

Layout of the mapped file (little endian)::

    0   u64  the draft's spin deadline (time.monotonic_ns(): one clock per host)
    8   u64  1 while the verify side spins for an answer, else 0
    64  slot TO_DRAFT    u64 sequence, u64 length, payload
    64 + slot_bytes      slot TO_VERIFY, the same

A writer stores the payload and its length, then the sequence number (one aligned
8-byte store); a reader that sees a new sequence copies the payload, then re-reads
length and sequence and retries a torn read. The protocol has one request in flight,
so a slot is not rewritten while its last message is unread.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time

TO_DRAFT, TO_VERIFY = 0, 1
HEADER = 64
SLOT_HEAD = 16
SLOT_BYTES = 1 << 18            # payload room per slot; larger messages take the socket
_U64 = struct.Struct("<Q")


class Mailbox:
    def __init__(self, path: str, fd: int, slot_bytes: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(fd, HEADER + 2 * (SLOT_HEAD + slot_bytes))
        os.close(fd)
        self._buf = memoryview(self._map)
        self._seen = [0, 0]         # last sequence read, per slot
        self._sent = [0, 0]         # last sequence written, per slot

    @classmethod
    def create(cls, directory: str = "/dev/shm", slot_bytes: int | None = None) -> Mailbox:
        slot_bytes = slot_bytes or SLOT_BYTES
        path = os.path.join(directory, f"treespec-mailbox-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, HEADER + 2 * (SLOT_HEAD + slot_bytes))
        return cls(path, fd, slot_bytes)

    @classmethod
    def attach(cls, path: str) -> Mailbox:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        return cls(path, fd, (size - HEADER) // 2 - SLOT_HEAD)

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid); fine if it is already gone."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._buf.release()
        self._map.close()

    # ------------------------------------------------------------------ slots
    def _slot(self, slot: int) -> int:
        return HEADER + slot * (SLOT_HEAD + self.slot_bytes)

    def fits(self, payload: bytes) -> bool:
        return len(payload) <= self.slot_bytes

    def post(self, slot: int, payload: bytes) -> None:
        """Write payload into slot (it must fit) and publish it."""
        off, n = self._slot(slot), len(payload)
        self._buf[off + SLOT_HEAD:off + SLOT_HEAD + n] = payload
        _U64.pack_into(self._buf, off + 8, n)
        self._sent[slot] += 1
        _U64.pack_into(self._buf, off, self._sent[slot])

    def take(self, slot: int) -> bytes | None:
        """The slot's message if one arrived since the last take, else None."""
        off = self._slot(slot)
        seq = _U64.unpack_from(self._buf, off)[0]
        if seq == self._seen[slot]:
            return None
        while True:
            (n,) = _U64.unpack_from(self._buf, off + 8)
            data = bytes(self._buf[off + SLOT_HEAD:off + SLOT_HEAD + n])
            if (_U64.unpack_from(self._buf, off + 8)[0] == n
                    and _U64.unpack_from(self._buf, off)[0] == seq):
                self._seen[slot] = seq
                return data
            seq = _U64.unpack_from(self._buf, off)[0]

    # ------------------------------------------------------------------ who spins
    def set_draft_spinning_until(self, deadline_ns: int) -> None:
        _U64.pack_into(self._buf, 0, deadline_ns)

    def draft_spinning(self, margin_ns: int = 1_000_000) -> bool:
        """Whether the draft will still be spinning margin_ns from now."""
        return _U64.unpack_from(self._buf, 0)[0] > time.monotonic_ns() + margin_ns

    def set_verify_waiting(self, waiting: bool) -> None:
        _U64.pack_into(self._buf, 8, int(waiting))

    def verify_waiting(self) -> bool:
        return _U64.unpack_from(self._buf, 8)[0] == 1
