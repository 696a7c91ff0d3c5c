"""What one engine step runs: the scheduler's decision, handed to the engine whole.

After vLLM v1's `SchedulerOutput`: `Scheduler.schedule()` returns one frozen
`SchedulerOutput` holding everything the step needs, and nothing the engine
has to collect from the scheduler afterwards:

    decodes    one token each for running requests    } the batch, in this order:
    prefills   prompt (or recompute) chunks            } ModelRunner's flat layout
    kv_loads   given K/V to copy into pages first (KVImport at admission)
    preempted  requests whose pages were taken back (they recompute later)

Page tables were already updated by the scheduler; the engine applies the loads,
runs the batch, and advances each scheduled sequence by its `num_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence and how many of its tokens this step computes.

    The tokens are seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens +
    num_new_tokens] (num_new_tokens >= 1); their pages are already allocated. Read-only
    by convention: not frozen, since one is built per sequence per step and a frozen
    __init__ costs more there (measured: +3% on schedule() + prepare() at 64 decodes).
    """

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's newest token (so a token is sampled)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Given K/V to copy into a newly admitted request's pages before the forward pass.

    Attributes:
        seq: the request (its HandOver.kv_import is consumed: set to None).
        block_ids: page ids to fill, in order (n of them); the request's block_table
            entries covering its imported tokens that the prefix cache did not.
        blocks: the source, [n, num_layers, 2, block_size, num_kv_heads, head_dim], a view
            of the KVImport's blocks (CPU or device, any float dtype; cast on copy).
    """

    seq: Sequence
    block_ids: tuple[int, ...]
    blocks: torch.Tensor


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work (see module doc). Built by Scheduler.schedule(), read by the engine.

    Attributes:
        decodes: running sequences that compute their one newest token (num_new_tokens 1).
        prefills: sequences computing a chunk of prompt (or of recompute after
            preemption), oldest first; num_new_tokens >= 1.
        kv_loads: copies into pages to make before the forward pass (KVLoad), in
            admission order.
        preempted: sequences preempted this step (pages freed, back at the head of the
            waiting queue). One may be readmitted by the same step and then is also in
            prefills.
        scheduled: decodes + prefills, the batch in the order ModelRunner lays it out
            (derived; not an argument).
    """

    decodes: tuple[ScheduledSeq, ...] = ()
    prefills: tuple[ScheduledSeq, ...] = ()
    kv_loads: tuple[KVLoad, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    scheduled: tuple[ScheduledSeq, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduled", self.decodes + self.prefills)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run (no tokens scheduled)."""
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens this step computes (at most the scheduler's token budget)."""
        return sum(s.num_new_tokens for s in self.scheduled)


__all__ = ["KVLoad", "ScheduledSeq", "SchedulerOutput"]
