"""Generation servicer: protobuf <-> verify engine, nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from treespec.common.wire import convert as wire
from treespec.common.serving.errors import InvalidRequest, Unavailable
from treespec.common.model.tokenizer import Detokenizer
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from treespec.verify_service.engine import VerifyEngine
from treespec.verify_service.request import GenRequest, Stats

class EngineFailure(RuntimeError):
    """The engine could not finish a request; the interceptor maps it to INTERNAL."""


FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
          "cancelled": pb.FINISH_REASON_CANCELLED}


MAX_REQUEST_ID = 256                # characters
MAX_STOP_IDS = 1024


def check_fields(m: pb.GenerateRequest, vocab_size: int, max_prompt_bytes: int,
                 tokenizer: Any | None) -> None:
    """What can be refused before any work (InvalidRequest names the field)."""
    if m.prompt and m.prompt_ids:
        raise InvalidRequest("give prompt or prompt_ids, not both")
    if m.prompt and tokenizer is None:
        raise InvalidRequest("this checkpoint has no tokenizer: send prompt_ids")
    if len(m.prompt) > max_prompt_bytes or len(m.prompt.encode()) > max_prompt_bytes:
        raise InvalidRequest(f"prompt: over {max_prompt_bytes} bytes (the server's "
                             "--max-prompt-bytes)")
    if len(m.request_id) > MAX_REQUEST_ID:
        raise InvalidRequest(f"request_id: {len(m.request_id)} characters, at most "
                             f"{MAX_REQUEST_ID}")
    if len(m.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidRequest(f"stop_token_ids: {len(m.stop_token_ids)} ids, at most "
                             f"{MAX_STOP_IDS}")
    bad = next((t for t in m.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop_token_ids: {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")


def request_from_pb(m: pb.GenerateRequest, ids: tuple[int, ...]) -> GenRequest:
    """m with its prompt as token ids (the tokenizer's, for a text prompt)."""
    return GenRequest(prompt_ids=ids, max_tokens=m.max_tokens,
                      stop_token_ids=frozenset(m.stop_token_ids), ignore_eos=m.ignore_eos,
                      no_speculation=m.no_speculation, request_id=m.request_id,
                      sampling={f.name: v for f, v in m.sampling.ListFields()})


def stats_to_pb(s: Stats) -> pb.RequestStats:
    return pb.RequestStats(**vars(s))


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: VerifyEngine, tokenizer: Any | None, model_name: str,
                 max_prompt_bytes: int = 1 << 20) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_prompt_bytes = max_prompt_bytes
        # text prompts are tokenized here, never on the event loop (a long one took
        # seconds, stalling every stream)
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _prompt_ids(self, m: pb.GenerateRequest) -> tuple[int, ...]:
        check_fields(m, self.engine.spec.vocab_size, self.max_prompt_bytes, self.tokenizer)
        if not m.prompt:
            return tuple(m.prompt_ids)
        loop = asyncio.get_running_loop()
        return tuple(await loop.run_in_executor(self._tokenize, self.tokenizer.encode,
                                                m.prompt))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        ids = await self._prompt_ids(request)
        seq = self.engine.submit(request_from_pb(request, ids))
        detok = Detokenizer(self.tokenizer)
        try:
            while True:
                out = await seq.out.get()
                if out.error is not None:
                    raise EngineFailure(out.error)
                if out.finish_reason == "abort":
                    raise Unavailable(f"the server stopped before this request finished "
                                      f"({out.stats.completion_tokens} tokens were sent); "
                                      "retry it")
                done = out.finish_reason is not None
                msg = pb.GenerateResponse(token_ids=out.token_ids,
                                          text=detok.push(out.token_ids, final=done))
                if done:
                    msg.finish_reason = FINISH[out.finish_reason]
                    msg.stats.CopyFrom(stats_to_pb(out.stats))
                yield msg
                if done:
                    return
        finally:
            self.engine.cancel(seq)

    async def GetInfo(self, request: pb.GenerationInfoRequest, context: grpc.aio.ServicerContext
                      ) -> pb.GenerationInfo:
        e = self.engine
        info = pb.GenerationInfo(model=self.model_name, vocab_size=e.spec.vocab_size,
                                 eos_token_ids=list(e.spec.eos_token_ids),
                                 max_model_len=e.max_model_len,
                                 has_tokenizer=self.tokenizer is not None,
                                 sampling_defaults=pb.SamplingParams(**e.sampling_defaults))
        link = e.link
        if link is not None and link.info is not None:
            info.envelope.CopyFrom(wire.envelope_to_pb(link.info.envelope))
            info.proposer = link.info.proposer
            info.draft_connected = link.ready
        return info
