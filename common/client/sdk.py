"""The Python client SDK for the Generation service, sync and asyncio.

    with TreespecClient("127.0.0.1:50051") as c:
        c.wait_ready(30)
        for chunk in c.generate_stream(prompt="def add(", max_tokens=32):
            print(chunk.text, end="", flush=True)
        done = c.generate(prompt_ids=[1, 2, 3], max_tokens=8)
        print(done.token_ids, done.finish_reason, done.stats["accepted_tokens"])

Every gRPC failure surfaces as `TreespecError`, carrying the status code and details.
Leaving a stream early (break, close, task cancellation) cancels the server-side call.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from treespec.common.serving.auth import metadata
from treespec.common.serving.tls import ClientTLS, channel
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}
STAT_KEYS = ("steps", "draft_tokens", "accepted_tokens", "fallback_steps",
             "planned_plain_steps", "prompt_tokens", "completion_tokens", "cached_tokens")
_RETRY_READY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000),
                    ("grpc.max_receive_message_length", -1)]


class TreespecError(RuntimeError):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "TreespecError":
        return cls(err.code(), err.details() or "")


@dataclass(frozen=True)
class Chunk:
    """The tokens of one step; the last chunk has finish_reason and stats set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict[str, int] | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str            # "length" | "stop" | "cancelled"
    stats: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerInfo:
    model: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    draft_connected: bool
    proposer: str
    has_tokenizer: bool
    envelope: dict[str, int | str] | None  # name, depth, topk, num_nodes; None without a draft
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)  # for unset fields


class GenerateArgs(TypedDict, total=False):
    """Keyword arguments of generate / generate_stream (besides prompt)."""

    prompt_ids: list[int] | None
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    temperature: float | None     # sampling; None = the server's default (its checkpoint's
    top_p: float | None           # generation_config.json); temperature 0 = greedy
    top_k: int | None
    min_p: float | None
    seed: int | None              # the same seed and request: the same tokens
    no_speculation: bool          # plain decode for this request
    request_id: str
    timeout: float | None         # deadline in seconds; default the client's


def tokens_per_step(stats: dict[str, int]) -> float:
    """Mean tokens a decode step committed: 1.0 for plain decode, up to depth + 1 speculating.

    The first completion token comes from the prefill forward, which `steps` excludes.
    """
    return (stats["completion_tokens"] - 1) / stats["steps"] if stats["steps"] else 0.0


def build_request(prompt: str | None = None, prompt_ids: Iterable[int] | None = None,
                  max_tokens: int = 64, stop_token_ids: Iterable[int] = (),
                  ignore_eos: bool = False, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, seed: int | None = None,
                  no_speculation: bool = False, request_id: str = "",
                  timeout: float | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; exactly one of prompt / prompt_ids must be given. Sampling
    fields left None are not sent: the server's defaults apply. What the message
    cannot carry is refused here as the server would refuse it: TreespecError,
    code INVALID_ARGUMENT.

    `timeout` belongs to the call, not the message, and is ignored here.
    """
    if (prompt is None) == (prompt_ids is None):
        raise _invalid("give exactly one of prompt or prompt_ids")
    if not 1 <= max_tokens < 1 << 31:
        raise _invalid(f"max_tokens must be >= 1 and < 2**31, got {max_tokens}")
    sampling = pb.SamplingParams()
    for name, value in dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed).items():
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (ValueError, TypeError) as e:    # a value its field cannot hold
                raise _invalid(f"{name}: {e}") from None
    ids = _ids("prompt_ids", prompt_ids if prompt_ids is not None else ())
    stop_ids = _ids("stop_token_ids", stop_token_ids)
    try:
        return pb.GenerateRequest(
            request_id=request_id, prompt=prompt or "", max_tokens=max_tokens,
            prompt_ids=ids, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
            sampling=sampling, no_speculation=no_speculation)
    except (ValueError, TypeError) as e:
        raise _invalid(str(e)) from None


def _ids(name: str, values: Iterable[int]) -> list[int]:
    """values as a list of token ids, each in [0, 2**31) (the wire's int32)."""
    try:
        ids = [operator.index(v) for v in values]
    except TypeError:
        raise _invalid(f"{name} must be integers") from None
    bad = next((v for v in ids if not 0 <= v < 1 << 31), None)
    if bad is not None:
        raise _invalid(f"{name} must be in [0, 2**31), got {bad}")
    return ids


def _invalid(details: str) -> TreespecError:
    return TreespecError(grpc.StatusCode.INVALID_ARGUMENT, details)


def chunk_from_pb(m: pb.GenerateResponse) -> Chunk:
    reason = FINISH_REASONS.get(m.finish_reason)
    stats = {k: int(getattr(m.stats, k)) for k in STAT_KEYS} if reason is not None else None
    return Chunk(token_ids=list(m.token_ids), text=m.text, finish_reason=reason, stats=stats)


def info_from_pb(m: pb.GenerationInfo) -> ServerInfo:
    env = m.envelope
    envelope = ({"name": env.name, "depth": env.depth, "topk": env.topk,
                 "num_nodes": env.num_nodes} if m.HasField("envelope") and env.num_nodes else None)
    defaults = {f.name: v for f, v in m.sampling_defaults.ListFields()}
    return ServerInfo(model=m.model, vocab_size=m.vocab_size, eos_token_ids=list(m.eos_token_ids),
                      max_model_len=m.max_model_len, draft_connected=m.draft_connected,
                      proposer=m.proposer, has_tokenizer=m.has_tokenizer, envelope=envelope,
                      sampling_defaults=defaults)


class Collector:
    """Folds a stream of chunks into one Completion."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text: list[str] = []
        self.last: Chunk | None = None

    def add(self, c: Chunk) -> None:
        self.ids += c.token_ids
        self.text.append(c.text)
        self.last = c

    def result(self) -> Completion:
        if self.last is None or self.last.finish_reason is None:
            raise TreespecError(grpc.StatusCode.INTERNAL,
                                "the stream ended without a finish_reason")
        return Completion(token_ids=self.ids, text="".join(self.text),
                          finish_reason=self.last.finish_reason, stats=self.last.stats or {})


def _not_serving(r: health_pb2.HealthCheckResponse | None, err: grpc.RpcError | None) -> str | None:
    """None when a health check says SERVING, else why not; raises if waiting cannot help."""
    if err is not None:
        if err.code() not in _RETRY_READY:
            raise TreespecError.from_rpc(err) from None
        return err.code().name
    assert r is not None
    if r.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class TreespecClient:
    """Blocking client over one channel; use as a context manager or call close()."""

    def __init__(self, addr: str, timeout: float | None = None,
                 tls: ClientTLS | None = None, api_key: str | None = None) -> None:
        """tls: speak TLS (treespec.common.serving.tls.ClientTLS: a CA, and for mutual TLS a certificate);
        api_key: the bearer token a server with --api-key-file wants."""
        self._md = metadata(api_key)
        self.addr = addr
        self.timeout = timeout  # per-call deadline in seconds, None = none
        self._channel = channel(addr, tls, _CHANNEL_OPTIONS, aio=False)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate_stream(self, prompt: str | None = None, **kw: Unpack[GenerateArgs]) -> Iterator[Chunk]:
        """Chunks as the server commits them; arguments as in `build_request`."""
        call = self._stub.Generate(build_request(prompt, **kw),
                                   timeout=kw.get("timeout", self.timeout), metadata=self._md)
        try:
            for m in call:
                yield chunk_from_pb(m)
        except grpc.RpcError as e:
            raise TreespecError.from_rpc(e) from None
        finally:
            call.cancel()

    def generate(self, prompt: str | None = None, **kw: Unpack[GenerateArgs]) -> Completion:
        out = Collector()
        for c in self.generate_stream(prompt, **kw):
            out.add(c)
        return out.result()

    def info(self) -> ServerInfo:
        try:
            return info_from_pb(self._stub.GetInfo(pb.GenerationInfoRequest(), timeout=self.timeout,
                                                   metadata=self._md))
        except grpc.RpcError as e:
            raise TreespecError.from_rpc(e) from None

    def wait_ready(self, timeout: float = 30.0, service: str = "") -> None:
        """Polls gRPC health until `service` ("" = the whole server) is SERVING.

        Raises TimeoutError when it is not by then, TreespecError on an answer that
        waiting will not change (no health service, say).
        """
        deadline = time.monotonic() + timeout
        why = "no answer"
        while (left := deadline - time.monotonic()) > 0:
            try:
                r = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                       timeout=min(left, 2.0), wait_for_ready=True)
                why = _not_serving(r, None)
            except grpc.RpcError as e:
                why = _not_serving(None, e)
            if why is None:
                return
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"{self.addr} not ready after {timeout:g}s ({why})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TreespecClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTreespecClient:
    """asyncio client over one grpc.aio channel; `async with` or `await close()`."""

    def __init__(self, addr: str, timeout: float | None = None,
                 tls: ClientTLS | None = None, api_key: str | None = None) -> None:
        self._md = metadata(api_key)
        self.addr = addr
        self.timeout = timeout
        self._channel = channel(addr, tls, _CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate_stream(self, prompt: str | None = None, **kw: Unpack[GenerateArgs]) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(build_request(prompt, **kw),
                                   timeout=kw.get("timeout", self.timeout), metadata=self._md)
        try:
            async for m in call:
                yield chunk_from_pb(m)
        except grpc.RpcError as e:
            raise TreespecError.from_rpc(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kw: Unpack[GenerateArgs]) -> Completion:
        out = Collector()
        async for c in self.generate_stream(prompt, **kw):
            out.add(c)
        return out.result()

    async def info(self) -> ServerInfo:
        try:
            return info_from_pb(await self._stub.GetInfo(pb.GenerationInfoRequest(),
                                                         timeout=self.timeout,
                                                         metadata=self._md))
        except grpc.RpcError as e:
            raise TreespecError.from_rpc(e) from None

    async def wait_ready(self, timeout: float = 30.0, service: str = "") -> None:
        """As TreespecClient.wait_ready."""
        deadline = time.monotonic() + timeout
        why = "no answer"
        while (left := deadline - time.monotonic()) > 0:
            try:
                r = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=min(left, 2.0), wait_for_ready=True)
                why = _not_serving(r, None)
            except grpc.RpcError as e:
                why = _not_serving(None, e)
            if why is None:
                return
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"{self.addr} not ready after {timeout:g}s ({why})")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncTreespecClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
