"""What a request brings into the engine, or must leave behind, when it crosses a node.

A plain request computes its whole prompt here and only streams text back. A
request that is handed over between nodes (Mooncake's prefill -> decode path,
and prefix loads from the store) also carries K/V in or out, and on a decode
node starts with a token another node sampled. `HandOver` gathers that state
in one place: `Sequence.handover` is None for a plain request, so the step's
hot path tests one attribute. (A decode node's first token, sampled by the prefill
node, is no state here: it is the last prompt token of the Sequence and is never
reported again; LLMEngine.add_request.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_stream import LayerwiseKV
    from .types import KVImport


@dataclass
class HandOver:
    """One request's hand-over state (see module doc). Mutable: the engine consumes it.

    Attributes:
        kv_import: K/V of the prompt's first kv_import.num_tokens tokens (KVImport, CPU or
            device blocks [n, num_layers, 2, block_size, num_kv_heads, head_dim]) to copy
            into pages at admission instead of computing them. The scheduler sets it to
            None once it has scheduled the copy (a KVLoad); a request preempted before
            that still has it and loads it again when readmitted.
        export_kv: gather every block of the request (the partial last one included)
            into its final output (RequestOutput.kv_export).
        kv_stream: a LayerwiseKV the prompt's K/V is staged into layer by layer while
            it prefills (the prefill node's push), or None.
        announce_start: a decode node's continuation (first token sampled elsewhere):
            the engine tells LLMEngine.on_start when the request's first step begins,
            then clears it.
    """

    kv_import: KVImport | None = None
    export_kv: bool = False
    kv_stream: LayerwiseKV | None = None
    announce_start: bool = False


__all__ = ["HandOver"]
