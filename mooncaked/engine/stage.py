"""One stage of a chunked prefill pipeline (CPP, Mooncake section 3.3).

A pipeline group splits the decoder's layers into contiguous ranges, one per stage
(prefill node). A stage holds only its layers' weights (the embedding on the first,
the final norm and LM head on the last) and KV pages for its layers only:
`kv_cache[num_blocks, stage_layers, 2, block_size, num_kv_heads, head_dim]`, the engine's
layout restricted to the stage's layers. A prompt is cut into chunks; each chunk runs
through stage 0, its hidden states go to stage 1, and so on, so that chunk i+1 runs on
stage 0 while chunk i runs on stage 1. The last stage turns the prompt's last hidden
state into logits.

StageEngine is synchronous and single-request-at-a-time per call (a stage node serializes
its calls); each request owns a list of pages until `release`.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from mooncaked.kernels import attention_ops, cpu_isa
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.numerics import resolve as resolve_numerics
from mooncaked.model.weights import ModelConfig, load_weights
from mooncaked.utils import cdiv
from mooncaked.model.gguf_index import read_index
from mooncaked.model.weights import ModelLoadError

from .block_manager import BlockManager

RELEASE_WAIT_S = 5.0   # bound on a chunk's wait for pages being released (copied out: ms)


def split_layers(num_layers: int, num_stages: int, weights: list[float] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage, covering 0..num_layers.

    Even by default (the first stages take one more layer when it does not divide). With
    `weights` (each stage's share, e.g. from a profile so that stages take equal time),
    boundaries are the rounded cumulative shares, every stage keeping at least one layer.
    Raises: ValueError when num_stages < 1 or > num_layers, or weights has the wrong length
        or a non-positive entry.
    """
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    bounds = [0]
    if weights is None:
        q, r = divmod(num_layers, num_stages)
        for i in range(num_stages):
            bounds.append(bounds[-1] + q + (1 if i < r else 0))
    else:
        if len(weights) != num_stages or any(w <= 0 for w in weights):
            raise ValueError(f"layer split weights must be {num_stages} positive numbers, got {weights}")
        total, acc = sum(weights), 0.0
        for i, w in enumerate(weights[:-1]):
            acc += w
            b = round(num_layers * acc / total)
            bounds.append(min(max(b, bounds[-1] + 1), num_layers - (num_stages - 1 - i)))
        bounds.append(num_layers)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def model_num_layers(path) -> int:
    """The model's layer count from its metadata alone (config.json's num_hidden_layers, or
    a GGUF file's llama.block_count), without loading weights.
    Raises: ModelLoadError when the metadata lacks it or cannot be read."""
    from pathlib import Path  # noqa: PLC0415


    p = Path(path)
    try:
        if p.is_dir():
            import json  # noqa: PLC0415
            return int(json.loads((p / "config.json").read_text())["num_hidden_layers"])
        return int(read_index(p).metadata["llama.block_count"])
    except (OSError, KeyError, ValueError, IndexError) as e:
        raise ModelLoadError(f"{p}: cannot read the layer count: {e}") from e


@dataclass
class _StageSeq:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose K/V of this stage's layers are in the pages
    keys: list[bytes] = field(default_factory=list)   # block keys of the prompt's full blocks
    ran: bool = False    # a chunk ran (before that, matched blocks beyond `start` may be unpinned)
    releasing: int = 0   # pages counted in StageEngine.releasing (release_soon)


class StageOutOfPages(RuntimeError):
    """The stage has no free KV page for a request's next chunk."""


class StageEngine:
    """A pipeline stage: layers `layers` of the model, their KV pages, chunk by chunk.

    Args:
        model_path: a resolved GGUF file or safetensors directory.
        layers: this stage's contiguous layer range (split_layers).
        dtype: "auto", "float32" or "bfloat16" (weights, activations and KV; auto as
            model/numerics.py resolves it).
        kv_cache_bytes: memory for this stage's pages, bytes (a block holds only the
            stage's layers, so the same bytes hold more tokens than a full engine's).
        block_size: tokens per page; max_positions: longest prompt, tokens.
        num_threads: torch intra-op threads (0: leave torch's setting).
    Raises: ModelLoadError for a bad model or range; ValueError when one page does not fit.
    """

    def __init__(self, model_path, layers: range, dtype: str = "float32",
                 kv_cache_bytes: int = 256 * 1024 * 1024, block_size: int = 16,
                 max_positions: int = 8192, num_threads: int = 0, device: str = "cpu"):
        if num_threads:
            torch.set_num_threads(num_threads)
        t0 = time.monotonic()
        # auto's int8 prompt projections run over the file's blocks: keep them where the
        # nodes' auto takes those (the rest is dequantized below, as dtype float32 does)
        nodes = resolve_numerics(dtype, "auto", torch.device(device).type, cpu_isa.isa_level())
        cfg, tensors = load_weights(model_path, layers, keep_quantized=nodes.prompt_dtype == "int8")
        self.cfg: ModelConfig = cfg
        self.layers = layers
        self.is_first, self.is_last = layers.start == 0, layers.stop == cfg.num_layers
        dev = torch.device(device)
        # a stage runs dense weights; "auto" resolves as a whole-model engine's dtype does
        # (model/numerics.py), so the stages' KV and block keys match the group's nodes
        self.dtype = resolve_numerics(dtype, "dequantized", dev.type, cpu_isa.isa_level()).torch_dtype
        # weights counted dense (numel of each tensor, blocks or not) in the stage's dtype
        self.weight_bytes = sum(math.prod(t.shape) for t in tensors.values()) * self.dtype.itemsize
        # where a whole-model node's auto takes the fused step (fp32 with the file's blocks),
        # the prompt rows run row-invariant there (LlamaModel.row_invariant): so here too,
        # so that the group's prompt K/V and first token are the single node's bit for bit
        self.model = LlamaModel(cfg, tensors, self.dtype, dev, attention_ops(dev, "auto"),
                                max_positions=min(max_positions, cfg.max_position_embeddings),
                                layers=layers,
                                row_invariant=nodes.keep_quantized and nodes.dtype == "float32",
                                prompt_dtype=nodes.torch_prompt_dtype)
        del tensors
        self.block_size = block_size
        n = len(layers)
        self.block_bytes = n * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        num_blocks = kv_cache_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} cannot hold one stage block of "
                             f"{self.block_bytes} bytes")
        self.kv_cache = torch.zeros((num_blocks, n, 2, block_size, cfg.num_kv_heads, cfg.head_dim),
                                    dtype=self.dtype, device=dev)
        self.seqs: dict[str, _StageSeq] = {}
        # The page books are the engine's (block_manager.py): reference-counted pages and
        # the stage's prefix cache, its layers of finished full blocks by block key (a
        # cached block nobody uses is evicted least recently freed first, only when no free
        # page is left). The stage keeps its own per-request view (_StageSeq) over them.
        self.block_manager = BlockManager(num_blocks, block_size)
        # pages are taken in the compute thread (run_chunk) and matched / released from the
        # caller's event loop: one lock over the page books
        self._pages = threading.RLock()
        # pages of requests that will be released shortly (their slices being copied out,
        # cluster/cpp/stage_prefix.py): a chunk short of pages waits for them, not fails
        self._freed = threading.Condition(self._pages)
        self.releasing = 0
        self.load_s = time.monotonic() - t0
        self.pid = os.getpid()

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    def num_free_blocks(self) -> int:
        """Pages a request may take: free ones and cached ones nobody uses."""
        return self.block_manager.num_free_blocks

    def _ensure_pages(self, seq: _StageSeq, end: int) -> None:
        with self._pages:
            self._ensure_pages_locked(seq, end)

    def _ensure_pages_locked(self, seq: _StageSeq, end: int) -> None:
        need = cdiv(end, self.block_size) - len(seq.blocks)
        deadline = time.monotonic() + RELEASE_WAIT_S
        while need > self.num_free_blocks() and self.releasing > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._freed.wait(left)       # release() notifies
        if need > self.num_free_blocks():
            raise StageOutOfPages(f"need {need} pages, {self.num_free_blocks()} free")
        for _ in range(need):
            seq.blocks.append(self.block_manager.take_block())

    def match(self, request_id: str, keys: list[bytes]) -> int:
        """Starts request_id on the cached pages of its longest cached prefix (block keys of
        its full blocks, in order; store/keys.py) and remembers the keys for `release`.
        Returns the blocks matched (their tokens need no compute on this stage).
        Raises ValueError when the request already has pages."""
        with self._pages:
            return self._match_locked(request_id, keys)

    def _match_locked(self, request_id: str, keys: list[bytes]) -> int:
        if request_id in self.seqs:
            raise ValueError(f"{request_id} already has pages on this stage")
        seq = self.seqs[request_id] = _StageSeq(keys=list(keys))
        seq.blocks = self.block_manager.pin_cached(seq.keys)
        seq.num_tokens = len(seq.blocks) * self.block_size
        return len(seq.blocks)

    def block_shape(self) -> tuple[int, ...]:
        """One page of this stage: [stage_layers, 2, block_size, kv_heads, head_dim]."""
        return tuple(self.kv_cache.shape[1:])

    def append_blocks(self, request_id: str, blocks: torch.Tensor) -> int:
        """Continues a matched request's prefix with given K/V (a page each, e.g. from the
        store or a peer: cluster/cpp/stage_prefix.py), before its first chunk runs.

        Args:
            blocks: [n, stage_layers, 2, block_size, kv_heads, head_dim], this stage's layers
                of the request's next n full blocks (any device; cast to the stage dtype).
        Returns: the blocks appended (fewer than n when pages run out; they are kept under
            the request's keys at `release` like computed ones).
        Raises: KeyError for a request without `match`; ValueError after a chunk ran.
        """
        with self._pages:
            seq = self.seqs[request_id]
            if seq.ran or seq.num_tokens != len(seq.blocks) * self.block_size:
                raise ValueError(f"{request_id}: blocks can only extend a matched prefix")
            n = min(blocks.shape[0], self.num_free_blocks(), len(seq.keys) - len(seq.blocks))
            if n <= 0:
                return 0
            pages = [self.block_manager.take_block() for _ in range(n)]
            self.kv_cache[torch.tensor(pages, dtype=torch.long, device=self.kv_cache.device)] = \
                blocks[:n].to(device=self.kv_cache.device, dtype=self.dtype)
            seq.blocks += pages
            seq.num_tokens = len(seq.blocks) * self.block_size
            return n

    def finished_blocks(self, request_id: str, skip=None) -> tuple[list[bytes], list[int]]:
        """The request's full blocks whose K/V this stage holds (computed, matched or
        appended), for its store: (keys, page ids); `skip(key)` leaves blocks out (e.g.
        those stored already). The pages stay valid until the request's `release`.
        ([], []) for an unknown request."""
        with self._pages:
            seq = self.seqs.get(request_id)
            if seq is None:
                return [], []
            full = min(len(seq.keys), seq.num_tokens // self.block_size, len(seq.blocks))
            todo = [i for i in range(full) if skip is None or not skip(seq.keys[i])]
            return [seq.keys[i] for i in todo], [seq.blocks[i] for i in todo]

    def page_bytes(self, page: int) -> torch.Tensor:
        """Page `page` as a flat uint8 view [block_bytes] (on the stage's device); valid
        while a request holds the page."""
        return self.kv_cache[page].reshape(-1).view(torch.uint8)

    @torch.inference_mode()
    def run_chunk(self, request_id: str, start: int, inputs: torch.Tensor,
                  want_logits: bool = False) -> torch.Tensor:
        """Runs this stage's layers on tokens start..start+n-1 of a request.

        Args:
            request_id: the request (its pages are made on its first chunk).
            start: position of the chunk's first token; must equal the tokens already run.
            inputs: int64 token ids [n] on the first stage, else the previous stage's
                hidden states [n, hidden_size] (any float dtype; cast to the stage's).
            want_logits: on the last stage, return fp32 logits [vocab] of the chunk's last
                token instead of hidden states.
        Returns: hidden states [n, hidden_size] in the stage dtype (before the final norm),
            or fp32 logits [vocab] (last stage, want_logits).
        Raises: ValueError for a chunk out of order or logits asked of a non-last stage;
            StageOutOfPages when the pages are full.
        """
        seq = self.seqs.setdefault(request_id, _StageSeq())
        if not seq.ran and start < seq.num_tokens and start % self.block_size == 0:
            # matched more than another stage: recompute from `start` like every stage
            keep = start // self.block_size
            with self._pages:
                self.block_manager.release(seq.blocks[keep:])
                del seq.blocks[keep:]
            seq.num_tokens = start
        if start != seq.num_tokens:
            raise ValueError(f"{request_id}: chunk starts at {start}, stage has {seq.num_tokens} tokens")
        if want_logits and not self.is_last:
            raise ValueError("only the last stage has the LM head")
        n = inputs.shape[0]
        end = start + n
        self._ensure_pages(seq, end)
        dev, bs = self.model.device, self.block_size
        table = torch.tensor(seq.blocks, dtype=torch.long, device=dev)
        pos = torch.arange(start, end, dtype=torch.long, device=dev)
        slots = table[pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=0,
            prefill_block_tables=table.to(torch.int32).unsqueeze(0),
            prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor([end], dtype=torch.int32, device=dev))
        if self.is_first:
            x = inputs.to(device=dev, dtype=torch.long)
        else:
            x = inputs.to(device=dev, dtype=self.dtype)
        hidden = self.model.forward(x, pos, meta, self.kv_cache)
        seq.num_tokens, seq.ran = end, True
        if want_logits:
            return self.model.logits(hidden[-1:], num_decode_rows=0)[0]
        return hidden

    def read_kv(self, request_id: str) -> torch.Tensor:
        """The request's pages, [num_blocks, stage_layers, 2, block_size, kv_heads, head_dim]
        (a copy), for a layer-range KV push or tests. Raises KeyError for an unknown id."""
        seq = self.seqs[request_id]
        return self.kv_cache[torch.tensor(seq.blocks, dtype=torch.long)].clone()

    def release_soon(self, request_id: str) -> None:
        """Marks request_id's pages as about to be released (its K/V being copied out): a
        chunk of another request that lacks pages meanwhile waits up to RELEASE_WAIT_S for
        `release` instead of failing with StageOutOfPages."""
        with self._pages:
            seq = self.seqs.get(request_id)
            if seq is not None and not seq.releasing:
                seq.releasing = len(seq.blocks)
                self.releasing += seq.releasing

    def read_kv_layer_major(self, request_id: str, lo: int, hi: int) -> torch.Tensor:
        """Blocks lo..hi-1 of the request's pages, layer-major and contiguous:
        [stage_layers, hi - lo, 2, block_size, kv_heads, head_dim] (a copy, one gather), the
        source of a chunk's layer-wise KV push. Raises KeyError for an unknown id, IndexError
        for a block range the request does not hold."""
        seq = self.seqs[request_id]
        if not 0 <= lo <= hi <= len(seq.blocks):
            raise IndexError(f"{request_id}: blocks {lo}:{hi} outside 0:{len(seq.blocks)}")
        idx = torch.tensor(seq.blocks[lo:hi], dtype=torch.long, device=self.kv_cache.device)
        out = torch.empty((self.kv_cache.shape[1], hi - lo, *self.kv_cache.shape[2:]),
                          dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        # One index_select per layer (a block's layer slice is contiguous): ~2 ms for 32
        # blocks x 15 layers on one CPU thread; index_select(1) of the transposed cache
        # walks it element by element (~1 s for the same copy).
        for j in range(out.shape[0]):
            torch.index_select(self.kv_cache[:, j], 0, idx, out=out[j])
        return out

    def release(self, request_id: str) -> bool:
        """Frees the request's pages, keeping its full blocks whose K/V this stage has
        computed (or matched) in the prefix cache under their keys; False when it held none."""
        with self._pages:
            return self._release_locked(request_id)

    def _release_locked(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.releasing:
            self.releasing -= seq.releasing
        self._freed.notify_all()
        full = min(len(seq.keys), seq.num_tokens // self.block_size)
        for block, key in zip(seq.blocks[:full], seq.keys):
            self.block_manager.publish(block, key)   # newly computed: cache it
        self.block_manager.release(seq.blocks)
        return True


def prefill_through(stages: list[StageEngine], request_id: str, token_ids: list[int], start: int = 0,
                    chunk_tokens: int = 512) -> torch.Tensor:
    """Runs tokens start.. of a request through `stages` in order, chunk by chunk, in this
    process (no overlap: the reference the distributed pipeline must match).

    Returns: fp32 logits [vocab] of the last token. Raises: as StageEngine.run_chunk;
        ValueError when no token is given or stages do not chain 0..num_layers.
    """
    if start >= len(token_ids):
        raise ValueError("no tokens to prefill")
    if stages[0].layers.start != 0 or not stages[-1].is_last or any(
            a.layers.stop != b.layers.start for a, b in itertools.pairwise(stages)):
        raise ValueError("stages must chain their layer ranges from 0 to the last layer")
    ids = torch.tensor(token_ids, dtype=torch.long)
    logits = None
    for s in range(start, len(token_ids), chunk_tokens):
        e = min(s + chunk_tokens, len(token_ids))
        x = ids[s:e]
        for st in stages:
            x = st.run_chunk(request_id, s, x, want_logits=st.is_last and e == len(token_ids))
        logits = x
    return logits
