"""Verify service configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from treespec.common.serving.config import ServiceConfig
from treespec.common.serving.tls import ClientTLS


@dataclass(frozen=True, kw_only=True)
class VerifyConfig(ServiceConfig):
    model: str                        # checkpoint dir (or shipped name)
    draft: str | None = None          # HOST:PORT of a draft service; None = plain decode
    num_blocks: int = 4096            # target KV pages
    max_batch: int = 32               # running sequences per step
    max_model_len: int = 0            # 0 = the checkpoint's max_position_embeddings
    prefill_tokens: int = 4096        # prompt tokens prefilled per engine iteration (chunks)
    max_prompt_bytes: int = 1 << 20   # a text prompt longer than this is refused unread
    max_waiting: int = 1024           # requests queued beyond the batch; more: refused
    step_deadline_ms: float = 100.0   # wait this long for a proposal, then plain decode
    reconnect_s: float = 1.0          # retry period while the draft is unreachable
    draft_socket: str = "auto"        # auto: the draft's local socket if reachable; off: gRPC
    generation_config: str = "auto"   # sampling defaults: auto = the checkpoint's
                                      # generation_config.json; none = greedy
    acceptance: str = "coupled"       # sampled nodes: coupled (a node is accepted iff it
                                      # is the target's seeded draw) or rejection
                                      # (recursive rejection sampling with the drafter's q)
    speculation: str = "adaptive"     # verify_service/controller.py: adaptive, always, off
    busy_poll: str = "auto"           # wait for drafts and the device without sleeping:
                                      # auto (on when the device is CUDA), on, off
    batch_invariant: bool = True      # a row's bits independent of the batch: Triton's
                                      # invariant kernels where kernels is auto or triton
    draft_tls_ca: str | None = None   # reach the draft over TLS, trusting this CA
    draft_tls_cert: str | None = None  # and, for mutual TLS, with this certificate
    draft_tls_key: str | None = None
    draft_api_key_file: str | None = None   # a bearer token for the draft (its first)

    @property
    def draft_api_key(self) -> str | None:
        if not self.draft_api_key_file:
            return None
        from treespec.common.serving.auth import read_keys
        return read_keys(self.draft_api_key_file, "--draft-api-key-file")[0].decode()

    @property
    def draft_tls(self) -> ClientTLS:
        return ClientTLS(self.draft_tls_ca or None, self.draft_tls_cert or None,
                         self.draft_tls_key or None, flag="--draft-tls")

    @property
    def target_kernels(self) -> str:
        """The target's kernel backend (treespec.kernels.dispatch.select): the invariant
        one unless --batch-invariant off or --kernels reference (invariant anyway)."""
        return "invariant" if self.batch_invariant and self.kernels in ("auto", "triton") \
            else self.kernels

    def busy(self, device_type: str) -> bool:
        """Whether the engine waits on its event loop without sleeping."""
        return self.busy_poll == "on" or (self.busy_poll == "auto" and device_type == "cuda")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft is not None and ":" not in self.draft:
            raise ValueError(f"--draft wants HOST:PORT, got {self.draft!r}")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.prefill_tokens < 1:
            raise ValueError("--prefill-tokens must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0 (0: the checkpoint's positions)")
        if self.max_prompt_bytes < 1 or self.max_waiting < 1:
            raise ValueError("--max-prompt-bytes and --max-waiting must be >= 1")
        if self.draft_socket not in ("auto", "off"):
            raise ValueError(f"draft_socket must be auto or off, got {self.draft_socket!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError("generation_config must be auto or none, got "
                             f"{self.generation_config!r}")
        self.draft_tls                  # refuses half a pair or an unreadable file
        self.draft_api_key
        if self.acceptance not in ("rejection", "coupled"):
            raise ValueError(f"acceptance must be rejection or coupled, got {self.acceptance!r}")
        if self.speculation not in ("adaptive", "always", "off"):
            raise ValueError("speculation must be adaptive, always or off, got "
                             f"{self.speculation!r}")
        if self.busy_poll not in ("auto", "on", "off"):
            raise ValueError(f"busy_poll must be auto, on or off, got {self.busy_poll!r}")
        if self.step_deadline_ms <= 0 or self.reconnect_s <= 0:
            raise ValueError("step_deadline_ms and reconnect_s must be > 0")
