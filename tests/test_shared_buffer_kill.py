"""The same-host carrier's shared buffer (common/wire/shared_buffer.py) cannot outlive the
services: once the verify has mapped the draft's /dev/shm file the file is gone from
/dev/shm (both processes hold it only as a mapping), so killing both at once with
SIGKILL, before any step was sent, leaves nothing behind. Real processes through the CLI: the shipped tiny-code
target and its EAGLE-3 head, which reads target hidden states."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

import services
from treespec.common.model.paths import resolve_model
from treespec.common.wire.shared_buffer import SHM_DIR

MAPPED = re.compile(r"(/dev/shm/treespec-hidden-[0-9a-f]+)( \(deleted\))?$")


def shared_files(pid: int) -> dict[str, bool]:
    """The treespec shared buffers process pid maps: path -> whether it is unlinked."""
    with open(f"/proc/{pid}/maps") as f:
        found = (MAPPED.search(line.rstrip("\n")) for line in f)
        return {m.group(1): m.group(2) is not None for m in found if m}


@pytest.mark.skipif(not os.path.isdir(SHM_DIR) or not os.path.isdir("/proc/self"),
                    reason="needs /dev/shm and /proc")
def test_no_shared_memory_file_is_left_when_both_services_are_killed():
    target = resolve_model("tiny-code")
    with services.stack(target, "eagle3", resolve_model("tiny-code-eagle3"),
                        draft_args=("--target-embeddings", str(target))) as (draft, verify):
        deadline = time.monotonic() + 30
        while "hidden states through shared memory" not in verify.output():
            assert time.monotonic() < deadline, verify.output(40)
            time.sleep(0.05)
        on_draft, on_verify = shared_files(draft.proc.pid), shared_files(verify.proc.pid)
        for p in (draft.proc, verify.proc):
            os.kill(p.pid, signal.SIGKILL)
        for p in (draft.proc, verify.proc):
            p.wait(30)
    assert len(on_draft) == 1 and on_draft.keys() == on_verify.keys(), (on_draft, on_verify)
    assert all(on_draft.values()) and all(on_verify.values())    # unlinked while in use
    assert not any(os.path.exists(path) for path in on_draft)
