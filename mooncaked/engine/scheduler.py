"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (`max_num_batched_tokens`). Running decodes go first
(one token each), so a long prompt never stalls them; prefills (and recomputes) then
take chunks of what budget is left, oldest request first; waiting requests join while
budget, sequence slots and pages last. When pages run out, the newest running request
is preempted: its pages are freed (their keyed blocks stay in the prefix cache) and it
waits to be recomputed.

The budget exists to bound how long a prefill chunk holds up running decodes. A step in
which no running sequence decodes (an idle engine, a prefill node, only prefills or
recomputes in flight) has nothing to protect, so it gets the larger `idle_budget`
(`engine.idle_prefill_tokens`, default 2048): a prompt up to that size is prefilled in
one step instead of in budget-sized chunks, which saves the later chunks' re-reads of
the earlier KV and their per-step overhead (cold TTFT of 1,000 tokens: two 512-token
chunks 1.09x transformers, one step 0.96-1.0x; docs/benchmarks.md, "Issue 15, cold
TTFT"). The idle budget is still a bound (it caps a step's activations and how long a
request arriving meanwhile waits); pages bound admission as always. vLLM (v1) and SGLang
keep one fixed per-step cap instead (`max_num_batched_tokens`, `chunked_prefill_size`),
chunking a long prompt whether or not decodes run, and leave the trade-off to that
setting's size; here the small cap holds only while it protects something.

A request that brings K/V (HandOver.kv_import: a decode node's prompt, a prefix
loaded from the store) gets pages for it at admission instead of compute; the
copy into them is a KVLoad of the step. `schedule()` returns everything a step
needs as one SchedulerOutput (scheduler_output.py).
"""

from __future__ import annotations

from collections import deque

from mooncaked.utils import cdiv

from .block_manager import BlockManager
from .scheduler_output import KVLoad, ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SeqStatus


class Scheduler:
    """FCFS continuous-batching scheduler (see module doc).

    Args:
        block_manager: the page allocator.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget of one step, tokens.
        idle_prefill_tokens: token budget of a step in which no running sequence
            decodes, tokens (see module doc); 0 (or less than max_num_batched_tokens) keeps
            max_num_batched_tokens for every step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 idle_prefill_tokens: int = 0):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.idle_budget = max(max_num_batched_tokens, idle_prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens_total = 0
        self.prompt_tokens_total = 0

    def add(self, seq: Sequence) -> None:
        """Queues a new request."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out and frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)

    def has_work(self) -> bool:
        """True if any request is waiting or running."""
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _import_pages(self, seq: Sequence) -> tuple[bool, KVLoad | None]:
        """Pages for the K/V a waiting `seq` brings (HandOver.kv_import) beyond its prefix hit.

        Returns (ok, load): load is the KVLoad that fills the new pages (and
        seq.num_computed_tokens then counts the imported tokens), or None when there is
        nothing to import; ok is False when the pages are not there.
        """
        ho = seq.handover
        imp = ho.kv_import if ho is not None else None
        if imp is None or imp.num_tokens <= seq.num_computed_tokens:
            return True, None
        first = seq.num_computed_tokens // self.bm.block_size
        if not self.bm.allocate(seq, imp.num_tokens - seq.num_computed_tokens):
            return False, None
        last = cdiv(imp.num_tokens, self.bm.block_size)
        seq.num_computed_tokens = imp.num_tokens
        return True, KVLoad(seq, tuple(seq.block_table[first:last]), imp.blocks[first:last])

    def schedule(self) -> SchedulerOutput:
        """Picks this step's work; decodes first, then prefill chunks. Mutates page tables
        (allocations, preemptions) and consumes the admitted requests' kv_import."""
        decoding = any(not seq.is_prefilling for seq in self.running)
        budget = self.budget if decoding else self.idle_budget
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        loads: list[KVLoad] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        # 1. Running sequences, oldest first; preempt the newest when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running[-1]
                if id(victim) in scheduled or victim is seq:
                    victim = seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                (prefills if seq.is_prefilling else decodes).append(ScheduledSeq(seq, n))
                scheduled.add(id(seq))
                budget -= n
                i += 1
                continue
            # seq itself was preempted: the list shifted, stay at index i
        # 2. Waiting sequences join while budget, slots and pages last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits: no prefix hit (as vLLM)
            hit = 0 if seq.wants_prompt_logprobs else self.bm.match_prefix(seq)
            self.bm.allocate_prefix(seq, hit)
            ok, load = self._import_pages(seq)
            if ok:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                ok = self.bm.allocate(seq, n)
                if not ok and not self.running:
                    # Nothing left to preempt: prefill what fits now, the rest in later steps.
                    slack = len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens
                    n = min(n, self.bm.num_free_blocks * self.bm.block_size + slack)
                    ok = n > 0 and self.bm.allocate(seq, n)
            if not ok:
                self.bm.free_seq(seq)  # hold no pages while waiting; kv_import kept for later
                break
            self.waiting.popleft()
            if load is not None:
                loads.append(load)
                seq.handover.kv_import = None
            if not seq.prefix_hit_counted:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.prefix_hit_counted = True
                self.prefix_hit_tokens_total += seq.num_cached_tokens
                self.prompt_tokens_total += seq.num_prompt_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            (prefills if seq.is_prefilling else decodes).append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(tuple(decodes), tuple(prefills), tuple(loads), tuple(preempted))
