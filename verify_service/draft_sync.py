"""What a draft has heard of each sequence, over one draft connection.

The verify service is the only authority on committed tokens; the draft keeps a
cache of them. For each sequence it has told the draft about, ``DraftSync`` keeps
how many committed tokens the draft holds and the step whose tree the sequence got
last, so an update carries only the new tokens and names the accepted path against
that tree. A new connection (``reset``) and the draft's own ``resync`` start a
sequence over with a ``full`` update. Also here: the step ids and the sequences
released since the last request.

Example: step 5 sends seq 3 in full, [1, 2, 3]; the target accepts node 0 of its
tree and adds a bonus, committing [1, 2, 3, 8, 9]; step 6 sends seq 3 new_tokens
[8, 9], committed_len 5, accepted_nodes [0] of step 5. A sampling request's full
update carries its resolved parameters (and how its nodes are accepted: rejection
sampling or coupled), so the drafter draws with the same seeded noise.

Target hidden states, for a drafter that reads them (EAGLE-3), travel once per
committed token: an update's row i is the state at the token *before*
new_tokens[i] (the state that predicted it; a full update's row 0 has none and is
zeros), taken from the sequence's captured states on the device; all rows of a step
leave the GPU together, one copy through a pinned buffer, or on the same-host carrier
straight into the connection's shared buffer (common/wire/shared_buffer.py), whose
request then carries only where they lie. Where the draft has given its projection
(DrafterInfo.projected_width: its first use of the rows), the rows leave projected,
in one matrix product on the device: a third (EAGLE-3) or a fifth (DFlash) of the
bytes.

A prompt's states cross as the prefill makes them, not with the steps: ``catch_up``
makes a request, sent without waiting, of what the draft lacks of prompts of more than
CATCH_UP_FROM rows (while they prefill, and the last chunk's after), as much as the
shared buffer holds (across hosts MAX_HIDDEN_BYTES, as a step: the message is encoded on
the verify's event loop), so a prompt has crossed about when its prefill ends.
A step's own request leaves such sequences out (``syncing``): the draft's catch-up over
them never delays a step's answer. Example: a 2,048-token prompt prefilled in chunks of
512 crosses in four catch-ups of 512 rows, one after each chunk's forward.

Prefix caching: a sequence that reused the verify's cached KV of its first
``hidden_from`` tokens has no hidden states of them; its full update says so
(``cached_len``) and carries rows from new_tokens[hidden_from + 1] on, the draft taking
the prefix's state from its own cache. The verify reuses no more of a prefix than the
draft holds: ``prefix_held`` counts the leading page keys whose states this connection
has sent in full (a sequence's keys, once the draft holds the states of every token
whose KV is written). A draft that no longer holds a prefix it was told to take (evicted,
restarted) answers the sequence ``lost_prefix``: it runs plain from then on (the states
exist nowhere), and its keys are no longer counted as held, so the next request with
that prefix prefills it and both caches have it again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treespec.common.wire.codec import Staging
from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.common.spec.messages import Lookahead, SeqUpdate, SpecRequest

if TYPE_CHECKING:
    from treespec.verify_service.sequence import Sequence


# target hidden states one request carries at most in its message (a shared buffer
# bounds them by its size): a new sequence's prompt (8 KB a token projected at the
# Qwen3-8B EAGLE-3 and DFlash shapes, 24 / 40 KB not) is sent over as many steps as it
# takes. The bound keeps a step's answer inside the deadline (32 MB took ~100 ms to
# encode, carry and decode on a GPU host: every syncing step missed its deadline)
MAX_HIDDEN_BYTES = 8 << 20
# a prompt of more rows than this crosses in catch-up requests of its own, as it is
# prefilled; a shorter one goes with its first step, which waits for it
CATCH_UP_FROM = 64
# page keys whose states a connection remembers having sent (least recently used go)
MAX_HELD_KEYS = 1 << 18


@dataclass
class _Cursor:
    sent: int            # committed tokens the draft holds
    tree_step: int       # the step whose tree the sequence got last
    catching_up: bool = False       # its prompt crosses in catch-up requests


@dataclass
class Outgoing:
    """A step's request, and how it covers the sequences it was made for."""

    request: SpecRequest
    rows: list[int]                 # the sequences (indices) in it, in its order
    syncing: list[int]              # those whose hidden states are not all sent yet:
                                    # the draft's tree for them is for a prefix, unused
    ends: list[int]                 # per row: committed tokens the draft holds after it
    hidden_bytes: int = 0           # target hidden states it carries
    fresh: bool = False             # some sequence's prompt goes (in part): new to the draft
    # rows (indices) whose tree is a lookahead candidate: row -> its row in `ahead`
    hits: dict[int, int] = field(default_factory=dict)
    misses: int = 0                 # rows with candidates, none of them the outcome
    ahead: Lookahead | None = None  # the lookahead the hits come from
    asks_ahead: bool = False        # some row wants candidates for its next step
    catching_up: bool = False       # a catch-up request (DraftSync.catch_up)

    def catch_up(self, depth: int) -> bool:
        """Whether a sequence gets more new tokens than a step of depth commits."""
        return any(len(u.new_tokens) > depth + 1 for u in self.request.seqs)


@dataclass
class _Hits:
    """A sequence's lookahead record: steps with candidates, and a moving hit rate."""
    tries: int = 0
    rate: float = 0.5


# lookahead per sequence: after LOOKAHEAD_TRIES steps with candidates, a sequence whose
# moving hit rate (weight LOOKAHEAD_WEIGHT on the newest) is under LOOKAHEAD_FLOOR asks for
# none, but for one step in LOOKAHEAD_RETRY (its text may turn predictable again). The
# same weight and tries price lookahead as a whole (AheadPrice).
LOOKAHEAD_TRIES, LOOKAHEAD_WEIGHT, LOOKAHEAD_FLOOR, LOOKAHEAD_RETRY = 8, 1 / 4, 0.05, 64


@dataclass
class AheadPrice:
    """Whether lookahead pays on this connection: a hit saves its step a draft answer
    (``hop_s``, measured on steps that waited for one), and each step pays the time it
    waits for its lookahead to arrive (a draft slower than the verify makes it late).
    Moving means of both; asking stops while the saving falls short of the wait, but
    for one step in LOOKAHEAD_RETRY."""

    steps: int = 0
    gain_s: float = 0.0
    wait_s: float = 0.0
    hop_s: float | None = None

    def answered(self, seconds: float) -> None:
        self.hop_s = seconds if self.hop_s is None else \
            self.hop_s + LOOKAHEAD_WEIGHT * (seconds - self.hop_s)

    def step(self, hits: int, misses: int, waited_s: float) -> None:
        if hits + misses == 0 or self.hop_s is None:
            return
        self.steps += 1
        gain = hits / (hits + misses) * self.hop_s
        self.gain_s += LOOKAHEAD_WEIGHT * (gain - self.gain_s)
        self.wait_s += LOOKAHEAD_WEIGHT * (waited_s - self.wait_s)

    def worth(self, step_id: int) -> bool:
        return (self.steps < LOOKAHEAD_TRIES or self.gain_s > self.wait_s
                or step_id % LOOKAHEAD_RETRY == 0)


class DraftSync:
    def __init__(self, max_hidden_bytes: int | None = None, rejection: bool = False
                 ) -> None:
        self.rejection = rejection          # sampled nodes are accepted by rejection sampling
        self.epoch = 0                      # draft connections so far
        self.step_id = 0                    # the last request's step id
        self.max_hidden_bytes = max_hidden_bytes      # None: MAX_HIDDEN_BYTES in messages,
        self.shared: SharedBuffer | None = None       # the shared buffer's size in it
        self._cursors: dict[int, _Cursor] = {}
        self._released: list[int] = []
        self._staging = Staging()
        self.projection: torch.Tensor | None = None   # the draft's, as given
        self.lookahead = 0                  # candidates the draft pre-drafts a sequence
        self.ahead: Lookahead | None = None            # the newest lookahead received
        self._ahead_rows: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        self._hits: dict[int, _Hits] = {}
        self.price = AheadPrice()
        self._held: OrderedDict[bytes, None] = OrderedDict()   # page keys the draft has
        self._lost: set[int] = set()        # sequences the draft answered lost_prefix

    def reset(self, shared: SharedBuffer | None = None,
              projection: torch.Tensor | None = None) -> None:
        """A new draft connection (with its shared buffer and its projection [width,
        layers * hidden], if any): it knows no sequence."""
        self.epoch += 1
        self._cursors.clear()
        self._released = []
        self.take_ahead(None)
        self._hits.clear()
        self.price = AheadPrice()
        self._held.clear()
        self._lost.clear()
        self.use_shared(shared)
        self.projection = projection

    def _projected(self, row: torch.Tensor) -> torch.Tensor | None:
        """The projection on row's device and dtype, where it applies to such rows."""
        w = self.projection
        if w is None or w.shape[1] != row.shape[-1]:
            return None
        if w.device != row.device or w.dtype != row.dtype:
            w = self.projection = w.to(row.device, row.dtype)
        return w

    def take_ahead(self, ahead: Lookahead | None) -> None:
        """The draft's newest lookahead (None: forget the last)."""
        self.ahead = ahead
        self._ahead_rows = {} if ahead is None else ahead.candidates(self.lookahead)

    def _match(self, s: Sequence, c: _Cursor | None, end: int) -> tuple[bool, int | None]:
        """Whether s has candidates for this step, and the lookahead row of the one
        whose key is what s committed since its last tree (None: none is)."""
        if c is None or self.ahead is None or self.ahead.step_id != c.tree_step:
            return False, None
        cands = self._ahead_rows.get(s.seq_id)
        if not cands or end != len(s.tokens):
            return False, None
        new = tuple(s.tokens[c.sent:end])
        row = next((r for key, r in cands if key == new), None)
        h = self._hits.setdefault(s.seq_id, _Hits())
        h.tries += 1
        h.rate += LOOKAHEAD_WEIGHT * ((row is not None) - h.rate)
        return True, row

    def _wants_ahead(self, s: Sequence) -> bool:
        h = self._hits.get(s.seq_id)
        return bool(self.lookahead) and self.price.worth(self.step_id) and (
            h is None or h.tries < LOOKAHEAD_TRIES or h.rate >= LOOKAHEAD_FLOOR
            or self.step_id % LOOKAHEAD_RETRY == 0)

    def use_shared(self, shared: SharedBuffer | None) -> None:
        if self.shared is not None:
            self.shared.close()
        self.shared = shared

    def _budget(self) -> int:
        room = MAX_HIDDEN_BYTES if self.shared is None else self.shared.nbytes
        return room if self.max_hidden_bytes is None else min(room, self.max_hidden_bytes)

    def _sent(self, s: Sequence) -> int:
        c = self._cursors.get(s.seq_id)
        return 0 if c is None else c.sent

    def catching_up(self, s: Sequence) -> bool:
        """Whether s's prompt crosses in catch-ups: it has not all crossed, and it began
        so, with more than CATCH_UP_FROM rows to cross (counting those its prefill has yet
        to make; none of a reused prefix)."""
        c, prompt = self._cursors.get(s.seq_id), len(s.req.prompt_ids)
        if s.hidden is None or (c is not None and c.sent >= prompt):
            return False
        if c is not None and c.sent:
            return c.catching_up
        return max(len(s.tokens), prompt + 1) - s.hidden_from > CATCH_UP_FROM

    def prefix_held(self, keys: list[bytes]) -> int:
        """How many of these leading page keys the draft holds the states of."""
        n = 0
        for k in keys:
            if k not in self._held:
                break
            self._held.move_to_end(k)
            n += 1
        return n

    def lose(self, seq_ids: list[int]) -> None:
        """The draft lacks these sequences' cached prefixes (Proposal.lost_prefix)."""
        for i in seq_ids:
            if self._cursors.pop(i, None) is not None:
                self._lost.add(i)

    def _drop_lost(self, s: Sequence) -> bool:
        """Whether s was lost: then it runs plain, and its keys count as held no more."""
        if s.seq_id not in self._lost:
            return False
        self._lost.discard(s.seq_id)
        for k in s.pages.keys:
            self._held.pop(k, None)
        s.hidden = None
        return True

    def _row_bytes(self, s: Sequence) -> tuple[torch.Tensor | None, int]:
        """The projection s's rows leave through (if any), and a row's bytes on the way."""
        row = s.hidden.rows[0]
        proj = self._projected(row)
        return proj, (row.numel() if proj is None else proj.shape[0]) * row.element_size()

    def request(self, seqs: list[Sequence], hidden: bool, trace: dict[str, str],
                depth: int = 0) -> Outgoing:
        """The next step's request for seqs, trees to `depth` (0: the envelope's);
        hidden: send target hidden states, at most max_hidden_bytes of them (the rest
        of a sequence's follow in later steps; a prompt still catching up is left out)."""
        out = self._outgoing(trace, depth)
        budget = full = self._budget()
        parts: list[tuple[SeqUpdate, torch.Tensor]] = []
        proj = None
        for i, s in enumerate(seqs):
            c = self._cursors.get(s.seq_id)
            sent, end = self._sent(s), len(s.tokens)
            out.fresh |= sent < len(s.req.prompt_ids)
            part = None
            if self._drop_lost(s):
                out.syncing.append(i)               # plain from now on
                continue
            if hidden and s.hidden is not None:
                if self.catching_up(s):
                    out.syncing.append(i)           # crossing in catch-ups: not waited for
                    continue
                part, proj, row_bytes, end = self._rows(s, sent, end, budget)
                if end == sent:
                    out.syncing.append(i)           # nothing of it fits this step
                    continue
                if end < len(s.tokens):
                    out.syncing.append(i)
                budget -= 0 if part is None else part.shape[0] * row_bytes
            tried, hit = self._match(s, c, end)
            if hit is not None:
                out.hits[i] = hit
            out.misses += tried and hit is None
            wants = self._wants_ahead(s) and end == len(s.tokens)
            out.asks_ahead |= wants
            u = self._add(out, i, s, c, end, hit, wants)
            if part is not None:
                parts.append((u, part))
        out.ahead = self.ahead
        self._attach(out, parts, proj, full - budget)
        return out

    def catch_up(self, seqs: list[Sequence]) -> Outgoing | None:
        """A request of what the draft lacks of the sequences still catching up (prefilling
        ones included: as many rows as their prefill has made), at most what the transport
        carries in one request (the shared buffer's size, or MAX_HIDDEN_BYTES across hosts); sent
        without waiting, its trees unused. None when nothing is owed."""
        todo = [(i, s) for i, s in enumerate(seqs)
                if not self._drop_lost(s) and self.catching_up(s)]
        if not todo:
            return None
        out = self._outgoing({}, 0)
        out.catching_up = True
        budget = full = MAX_HIDDEN_BYTES if self.shared is None else self.shared.nbytes
        parts: list[tuple[SeqUpdate, torch.Tensor]] = []
        proj = None
        for i, s in todo:
            sent = self._sent(s)
            part, proj, row_bytes, end = self._rows(
                s, sent, min(len(s.tokens), s.hidden_from + s.hidden.len + 1), budget)
            if part is None:
                continue
            budget -= part.shape[0] * row_bytes
            out.fresh = True
            out.syncing.append(i)
            parts.append((self._add(out, i, s, self._cursors.get(s.seq_id), end, None, False),
                          part))
        if not parts:
            return None
        self._attach(out, parts, proj, full - budget)
        return out

    def _outgoing(self, trace: dict[str, str], depth: int) -> Outgoing:
        self.step_id += 1
        return Outgoing(SpecRequest(self.step_id, [], self._released, trace_context=trace,
                                    max_depth=depth), [], [], [])

    def _rows(self, s: Sequence, sent: int, end: int, budget: int
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int]:
        """s's device rows from sent towards end, as many as budget bytes take (None:
        none), the projection they leave through (if any), a row's bytes on the way and
        the committed tokens the draft holds with them (a full update naming a reused
        prefix brings its tokens with no rows)."""
        proj, row_bytes = self._row_bytes(s)
        first = sent or (s.hidden_from + 1 if s.hidden_from else 0)   # the first row's token
        end = max(first, min(end, first + budget // row_bytes))
        return (update_rows(s, sent, end) if end > first else None), proj, row_bytes, end

    def _add(self, out: Outgoing, i: int, s: Sequence, c: _Cursor | None, end: int,
             hit: int | None, wants: bool) -> SeqUpdate:
        """seqs[i]'s update, bringing the draft to its first `end` tokens, added to out."""
        sent = 0 if c is None else c.sent
        out.rows.append(i)
        out.ends.append(end)
        u = SeqUpdate(
            seq_id=s.seq_id, committed_len=end, new_tokens=s.tokens[sent:end],
            full=sent == 0, accepted_nodes=s.accepted_path if c is not None else [],
            accepted_step_id=c.tree_step if c is not None else 0,
            sampling=s.sampling if sent == 0 and not s.sampling.greedy else None,
            rejection=self.rejection,
            lookahead_hit=0 if hit is None else hit % self.lookahead + 1,
            lookahead=wants, cached_len=s.hidden_from if sent == 0 and s.hidden is not None
            else 0)
        out.request.seqs.append(u)
        return u

    def _attach(self, out: Outgoing, parts: list[tuple[SeqUpdate, torch.Tensor]],
                proj: torch.Tensor | None, nbytes: int) -> None:
        """Each update's device rows onto the host (all in one copy) and into it."""
        if not parts:
            return
        place = self._staging.host_copy if self.shared is None else self.shared.place
        for (u, _), r in zip(parts, to_host([t for _, t in parts], place, proj)):
            u.hidden = r
        out.hidden_bytes = nbytes

    def sent(self, seqs: list[Sequence], out: Outgoing) -> None:
        """out left (the draft may have applied it, answer or not)."""
        self._released = []
        for i, end in zip(out.rows, out.ends):
            s = seqs[i]
            self._cursors[s.seq_id] = _Cursor(end, out.request.step_id, out.catching_up)
            if s.hidden is not None and end > s.pages.kv_len:  # every state the KV has
                for k in s.pages.keys:
                    self._held[k] = None
                    self._held.move_to_end(k)
                while len(self._held) > MAX_HELD_KEYS:
                    self._held.popitem(last=False)

    def resync(self, seq_ids: list[int]) -> None:
        """The draft lost these: their next update is full."""
        for i in seq_ids:
            self._cursors.pop(i, None)

    @property
    def has_released(self) -> bool:
        return bool(self._released)

    def release(self, seq_ids: list[int]) -> None:
        """These ended; the draft hears it with the next request."""
        for i in seq_ids:
            self._hits.pop(i, None)
            self._lost.discard(i)
            if self._cursors.pop(i, None) is not None:
                self._released.append(i)


def update_rows(seq: Sequence, sent: int, end: int) -> torch.Tensor:
    """[end - sent, C] device rows for an update that brings a draft holding ``sent``
    of the sequence's tokens up to ``end`` of them (a full update naming a reused prefix
    of hidden_from tokens: [end - hidden_from - 1, C], from the state of token
    hidden_from on)."""
    hidden, base = seq.hidden.rows, seq.hidden_from
    if sent == 0 and base == 0:
        return torch.cat([torch.zeros_like(hidden[:1]), hidden[:end - 1]])
    lo = max(sent, base + 1)
    return hidden[lo - 1 - base:end - 1 - base]


def to_host(parts: list[torch.Tensor], place, proj: torch.Tensor | None = None
            ) -> list[torch.Tensor]:
    """The same tensors (each times proj.T, where given) on the host through one
    device-to-host copy, place (valid until its next copy)."""
    rows = torch.cat(parts)
    host = place(rows if proj is None else torch.nn.functional.linear(rows, proj))
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p.shape[0])
    return [host[a:b] for a, b in zip(offsets, offsets[1:])]
