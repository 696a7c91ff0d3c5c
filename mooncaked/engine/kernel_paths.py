"""Which kernel variants an engine runs, detected once at start, for the log, `ctl status`
and `mooncake bench engine --json` (issue 30).

`kernel_paths` reads the decisions the model and its kernel set actually made: the fused
decode step is on when model/fused.py `why_not` let LlamaModel build it, and prefill
attention takes the variant kernels/cpu_ops.py `prefill_path` picks for the model's dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mooncaked.kernels import cpu_isa
from mooncaked.model.llama import LlamaModel


@dataclass(frozen=True)
class KernelPaths:
    """The CPU and the kernel variants one engine runs.

    Attributes:
        cpu: the CPU's model name (kernels/cpu_isa.py `cpu_name`), or the CUDA device's name.
        isa: the ISA level the CPU kernels use ("portable", "avx2", "avx512_vnni",
            "avx512_bf16"; MOONCAKED_CPU_ISA caps it).
        decode_path: "fused-avx2" / "fused-avx512_vnni" (the fused decode step on that
            cpu_gemv variant, kernels/cpu_fused_decode.py, for every decode row),
            "per-op-torch" (the model's layers op by op: torch matmuls, cpu_ops' attention)
            or "per-op-triton".
        decode_why: why the fused step is off (model/fused.py `why_not`), None when on.
        prefill_path: prefill attention: "cpu_prefill-avx512_bf16", "sdpa", "sdpa-aligned" (SDPA
            in position-aligned blocks, row-invariant: an fp32 model with the fused step) or
            "triton".
        prompt_matmul: dtype of the prompt rows' layer projections ("float32", "bfloat16":
            LlamaModel.prompt_matmul, model/numerics.py).
    """

    cpu: str
    isa: str
    decode_path: str
    decode_why: str | None
    prefill_path: str
    prompt_matmul: str

    def to_json(self) -> dict:
        """The fields as a JSON object."""
        return asdict(self)


def kernel_paths(model: LlamaModel) -> KernelPaths:
    """The variants `model` runs on this machine (see KernelPaths)."""
    isa = cpu_isa.isa_level()
    ops = getattr(model.ops, "__name__", "").rsplit(".", 1)[-1]
    if model.device.type == "cuda":
        cpu = torch.cuda.get_device_name(model.device)
    else:
        cpu = cpu_isa.cpu_name()
    if model.fused is not None:
        decode = f"fused-{model.fused.isa}"   # the GEMV variant the step was built for
    else:
        decode = "per-op-triton" if ops == "triton_ops" else "per-op-torch"
    if ops == "triton_ops":
        prefill = "triton"
    elif ops == "cpu_ops" and model.row_invariant:
        prefill = "sdpa-aligned"   # reference.paged_prefill_attention_aligned
    elif ops == "cpu_ops":
        prefill = model.ops.prefill_path(model.dtype, model.dtype, model.cfg.head_dim)
    else:
        prefill = "sdpa"
    return KernelPaths(cpu, isa, decode, model.fused_decode_reason, prefill, model.prompt_matmul)
