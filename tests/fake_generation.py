"""An in-process Generation server with scripted answers, for client and CLI tests.

It streams `steps` (lists of token ids) as chunks, the last one with finish_reason
LENGTH and stats; refuses a negative temperature with INVALID_ARGUMENT as the real
service does;
records every request it saw and whether a stream was cancelled by its client.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self, steps: list[list[int]], tokenizer: bool = False,
                 step_delay_s: float = 0.0) -> None:
        self.steps = steps
        self.tokenizer = tokenizer
        self.step_delay_s = step_delay_s
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        self.requests.append(request)
        if request.sampling.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        n = sum(len(s) for s in self.steps)
        finished = threading.Event()
        # runs when the RPC ends for any reason; before the last step only if cancelled
        context.add_callback(lambda: finished.is_set() or self.cancelled.set())
        for i, ids in enumerate(self.steps):
            if i and self.step_delay_s:
                time.sleep(self.step_delay_s)
            if not context.is_active():
                return
            m = pb.GenerateResponse(token_ids=ids,
                                    text="".join(f"<{t}>" for t in ids) if self.tokenizer else "")
            if i == len(self.steps) - 1:
                finished.set()
                m.finish_reason = pb.FINISH_REASON_LENGTH
                m.stats.CopyFrom(pb.RequestStats(
                    prompt_tokens=len(request.prompt_ids) or len(request.prompt),
                    completion_tokens=n, steps=len(self.steps),
                    draft_tokens=0 if request.no_speculation else 4 * len(self.steps),
                    accepted_tokens=0 if request.no_speculation else n - len(self.steps),
                    fallback_steps=0))
            yield m

    def GetInfo(self, request, context):
        return pb.GenerationInfo(model="fake", vocab_size=96, eos_token_ids=[95],
                                 max_model_len=512, draft_connected=True, proposer="ngram",
                                 has_tokenizer=self.tokenizer,
                                 envelope=pb.TreeEnvelope(name="chain4", depth=4, topk=1,
                                                          num_nodes=4))


class FakeServer:
    """`with FakeServer(fake) as addr:` serves fake on a free loopback port."""

    def __init__(self, servicer: FakeGeneration, serving: bool = True) -> None:
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_GenerationServicer_to_server(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> str:
        self.server.start()
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)
