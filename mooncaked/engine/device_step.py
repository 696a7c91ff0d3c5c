"""A model step on an accelerator without host syncs: inputs up, sampled tokens down.

A step's inputs are built on the host (Python lists of token ids, slots and block
tables). Creating them directly on a CUDA device (`torch.tensor(..., device="cuda")`)
copies from pageable memory and waits for the stream, which stalls the host behind the
previous step's kernels every time. Here they are built on the CPU, put in pinned
memory and copied without blocking, so the host queues the whole step while the GPU
still runs the last one. The only device-to-host copy of a step is the sampled tokens
(`needs_host_sampling` says when the logits go down once instead, for sampling that
runs per row on the host).
"""

from __future__ import annotations

import dataclasses

import torch

from mooncaked.model.llama import AttentionMetadata
from mooncaked.model.sampling import SamplingRow


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory without blocking on CUDA (the
    caching host allocator keeps the pinned buffer until the copy completed); unchanged
    when `device` is the tensor's own."""
    if t.device.type != "cpu":
        return t.to(device, non_blocking=True)  # already on a device (a no-op on the same one)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def upload_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Moves a step's host inputs (ModelRunner.prepare's) to `device` (see `upload`).

    Every tensor field of the metadata moves (whatever fields it grows); other fields are
    copied as they are. Returns: (input_ids, positions, meta) on `device`.
    """
    moved = {f.name: upload(v, device) if isinstance(v, torch.Tensor) else v
             for f in dataclasses.fields(meta) for v in [getattr(meta, f.name)]}
    return upload(input_ids, device), upload(positions, device), dataclasses.replace(meta, **moved)


def needs_host_sampling(rows: list[SamplingRow]) -> bool:
    """True when sampling these rows on a device would read values back row by row:
    any penalty, temperature sampling or logprobs. Plain greedy rows sample with one
    argmax on the device and one copy of the token ids."""
    return not all(r.params.greedy and r.params.repetition_penalty == 1.0 and not r.params.presence_penalty
                   and not r.params.frequency_penalty and r.params.logprobs is None for r in rows)


__all__ = ["needs_host_sampling", "upload", "upload_step"]
