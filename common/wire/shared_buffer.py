"""Target hidden states beside the hop, in memory both services map.

On the same-host carrier (common/wire/frames.py) a draft that reads target hidden states
(EAGLE-3) makes one buffer per connection, a file under /dev/shm, and names it in
its hello. The verify service maps it (registered with CUDA where it can be, so the
device writes into it directly), copies a step's hidden states into it in one
device-to-host copy, and its request says only where they lie
(``Tensor.shared_offset``); the draft reads them from the same pages (registered
with CUDA on its side too) into its own memory. No protobuf bytes, no socket copies:
on the H200 host 24 KB a token through protobuf ran at about 0.3 GB/s and a batch of
32 new 1024-token prompts took about 100 steps to cross (bench/NOTES.md, twelfth
session).

One request is in flight on a connection at a time (the verify service sends the
next only after the answer), so a request's states always start at offset 0 and
the draft has read them (copied them out) before it answers.

The file lives in /dev/shm only while one side has yet to map it: the verify
unlinks it as soon as it has mapped it (``attach``), so services killed together
(SIGKILL, no cleanup) leave nothing behind; the memory goes with the last mapping.
A verify that does not map it (another host's /dev/shm, another user) leaves it to
the draft, which unlinks it when the first request arrives or the connection ends.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets

import torch

log = logging.getLogger("treespec.shared_buffer")

SHM_DIR = "/dev/shm"
SHARED_BYTES = 64 << 20          # a connection's buffer: a step's states at most


class SharedBuffer:
    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.nbytes = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.nbytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = self.bytes.data_ptr()
        self._pinned = False
        self._unlinked = False

    @classmethod
    def create(cls, nbytes: int = SHARED_BYTES, pin: bool = False) -> SharedBuffer | None:
        """A new buffer (the draft's side), or None where there is no /dev/shm; registered
        with CUDA when pin is set and CUDA takes it (the draft's copies of a step's rows
        to its device then skip the driver's bounce buffer)."""
        if not os.path.isdir(SHM_DIR):
            return None
        path = os.path.join(SHM_DIR, f"treespec-hidden-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)             # sparse: pages exist once written
            buf = cls(path, fd)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return buf._pin() if pin else buf

    @classmethod
    def attach(cls, path: str, pin: bool) -> SharedBuffer:
        """The draft's buffer at path (the verify's side; OSError if not reachable),
        mapped, then unlinked (both sides hold it now); registered with CUDA when pin
        is set and CUDA takes it."""
        if not path.startswith(SHM_DIR + "/treespec-hidden-"):
            raise OSError(f"not a treespec shared buffer: {path!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size == 0:
                raise OSError(f"{path} is empty")
            buf = cls(path, fd)
        finally:
            os.close(fd)
        try:
            buf.unlink()
        except OSError as e:         # not ours to remove: the draft does it
            log.debug("left %s to the draft (%s)", path, e)
        return buf._pin() if pin else buf

    def _pin(self) -> SharedBuffer:
        if self.nbytes:
            self._pinned = torch.cuda.cudart().cudaHostRegister(self._base, self.nbytes, 0) == 0
        return self

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """t copied to the buffer's start (one copy, complete on return)."""
        n = t.numel() * t.element_size()
        if n > self.nbytes:
            raise ValueError(f"{n} bytes do not fit a shared buffer of {self.nbytes}")
        host = self.bytes[:n].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.current_stream(t.device).synchronize()
        return host

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where t's bytes lie in the buffer, or None if they are not in it."""
        at = t.data_ptr() - self._base
        n = t.numel() * t.element_size()
        return at if t.is_contiguous() and 0 <= at and at + n <= self.nbytes else None

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor at offset (ValueError if it does not lie inside the buffer). Valid
        until the next request: copy it before answering."""
        n = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or offset + n > self.nbytes:
            raise ValueError(f"a {n}-byte tensor at offset {offset} is outside the "
                             f"{self.nbytes}-byte shared buffer")
        return self.bytes[offset:offset + n].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (the mappings stay); a file already gone is no error."""
        if not self._unlinked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._unlinked = True

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base)
            self._pinned = False
        self.bytes = None
        try:
            self._map.close()
        except BufferError:          # a view is still alive; the mapping goes with it
            pass
