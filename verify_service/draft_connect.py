"""What a draft link sets up on connecting, besides the stream: the draft's projection of
the hidden states it reads, its local socket (the same host) and the shared buffer that
socket names. Each is optional: without it the link runs over gRPC, with hidden states
unprojected or in the messages."""

from __future__ import annotations

import asyncio
import logging

import torch

from treespec.common.spec.messages import DrafterInfo
from treespec.common.wire import codec, frames
from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

log = logging.getLogger("treespec.verify.draft_link")


async def fetch_projection(stub: pb_grpc.DrafterStub, info: DrafterInfo,
                           metadata: tuple | None) -> torch.Tensor | None:
    """The draft's projection of the hidden states it reads, where it gives one."""
    if not (info.projected_width and info.target_hidden_layers):
        return None
    blocks = [codec.decode(m) async for m in
              stub.GetProjection(pb.ProjectionRequest(), timeout=60, metadata=metadata)]
    w = torch.cat(blocks) if blocks else None
    if w is None or w.dim() != 2 or w.shape[0] != info.projected_width:
        raise RuntimeError(f"draft announced a projection to {info.projected_width} "
                           f"columns but sent {None if w is None else tuple(w.shape)}")
    return w


async def open_local(info: pb.DrafterInfo) -> frames.FrameStream | None:
    """The draft's local socket, when it advertises one and it answers as that draft."""
    if not (info.local_socket and info.instance_id):
        return None
    try:
        return await frames.FrameStream.open(info.local_socket, info.instance_id,
                                             pb.Proposal.FromString)
    except (OSError, asyncio.TimeoutError, frames.FrameError) as e:
        log.info("draft's local socket %s not usable here (%s)", info.local_socket, e)
        return None


def attach_shared(call: object, info: DrafterInfo) -> SharedBuffer | None:
    """The shared buffer the draft named in call's hello, when it reads hidden states."""
    path = getattr(call, "shared_path", None)
    if not (path and info.target_hidden_layers):
        return None
    try:
        return SharedBuffer.attach(path, pin=torch.cuda.is_available())
    except OSError as e:
        log.info("draft's shared buffer %s not usable here (%s): hidden states travel "
                 "in the messages", path, e)
        return None
