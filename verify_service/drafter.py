"""What the verify engine needs from a draft, and why a step may go without one.

Each step the engine asks its ``Drafter`` once for a tree per speculating sequence
and, as sequences end, tells it to forget them. It never sees how the draft is
reached: ``treespec.verify_service.draft_link.DraftLink`` is the draft service over the
local socket or gRPC; tests drive the engine with drafters in the same process.
Whatever a drafter answers, the engine checks it before the target sees it: a
broken draft costs a step's speculation, never a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import TreeBatch

if TYPE_CHECKING:
    from treespec.verify_service.sequence import Sequence

# why a speculating step ran as plain decode; per sequence also "empty_tree" (a tree came,
# all padding), "syncing" (the draft was still being sent its hidden states),
# "no_hidden_states" (admitted before a drafter that reads them connected) and
# "draft_max_model_len" (longer than the draft takes, by its handshake);
# "off_by_controller": the speculation budget (verify_service/controller.py) was 0, a
# planned plain step rather than a fallback; "draft_error": asking the draft raised
Fallback = Literal["no_draft", "disconnected", "busy", "deadline", "invalid_proposal",
                   "draft_error", "off_by_controller"]


@dataclass
class Drafted:
    """A drafter's answer for one step: trees, or the reason there are none."""

    trees: TreeBatch | None                 # one row per sequence in rows
    fallback: Fallback | None = None        # set when trees is None
    step_id: int = 0                        # the drafter's id for the step; 0: not asked
    # the hop's time stamps (ns): request handed over, answer read, and the draft's
    # own read and send (0 when it does not stamp); see observer.hop_parts
    stamps: tuple[int, int, int, int] | None = None
    # sequences (indices) still being synced with the draft: their rows are padding
    syncing: list[int] = field(default_factory=list)
    hidden_bytes: int = 0                   # target hidden states the request carried
    # the request brought some sequence more new tokens than a step commits (a new one,
    # or one back from a rest): the draft caught up, so the step's time is not a step's
    catch_up: bool = False
    fresh: bool = False                     # ... and some sequence was new to the draft
    # which of the sequences asked (indices) the trees' rows are for; None: all, in order
    rows: list[int] | None = None
    # rows whose tree is a lookahead candidate (drafted while the last step verified),
    # and rows that had candidates but none for the step's outcome
    lookahead_hits: int = 0
    lookahead_misses: int = 0


class Drafter(Protocol):
    @property
    def info(self) -> DrafterInfo | None:
        """The draft's handshake (envelope, proposer, target layers it reads), None
        before the first one."""

    @property
    def ready(self) -> bool:
        """Whether a step asked now can get trees."""

    async def propose(self, seqs: list[Sequence], trace: dict[str, str],
                      depth: int = 0, step_s: float | None = None) -> Drafted:
        """Trees for these sequences (their committed tokens, the path accepted from
        their last tree, their target hidden states when the draft reads them);
        trace: the W3C carrier of the step's span ({} when untraced); depth: nodes
        deeper will not be verified (0: the whole envelope); step_s: the step's
        expected cost, if known (a longer catch-up is not worth waiting for)."""

    def release(self, seq_ids: list[int]) -> None:
        """These sequences ended; the draft may forget them."""

    def prefix_held(self, keys: list[bytes]) -> int:
        """How many of these leading prefix-cache page keys the draft holds its own
        state of (asked only for a drafter that reads hidden states: a sequence reuses no
        more of a cached prefix, whose states it does not have)."""

    async def catch_up(self, seqs: list[Sequence]) -> None:
        """Send, without waiting, the target hidden states the draft lacks of prompts
        still crossing (prefilling ones as far as prefilled); only called for a drafter
        that reads them (DrafterInfo.target_hidden_layers)."""

    def take_unwaited(self) -> tuple[float, float]:
        """Seconds the draft spent since the last call on requests no step waited for
        (catch-ups sent without waiting, answers past the deadline): on returning
        sequences, and on requests bringing new prompts; the controller counts them as
        tries' cost."""

    async def idle(self) -> None:
        """The engine has nothing to run: tell the draft now what ended (it would
        otherwise hear it with the next step, and hold their state until then)."""
