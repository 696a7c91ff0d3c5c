"""mooncaked: a KVCache-centric, disaggregated LLM serving daemon (after Mooncake, FAST'25)."""

import os

__version__ = "0.1.0"

# torch's OpenMP runtime (libgomp) keeps each idle worker spinning for GOMP_SPINCOUNT
# iterations (300,000 by default, milliseconds) after every parallel region. Our Numba
# kernels that split work over their own threads (kernels/cpu_gemm.py's prompt GEMM)
# then share the cores with spinning workers: at 2 torch threads a 1,000-token cold
# prefill took 1.55 s either way (AMD EPYC Zen 4, AVX2 path). With 10,000 the same
# prefill takes 1.09 s and torch's own fp32 path is unchanged (1.58 s). libgomp reads it
# when torch loads, so it is set here, before any of our modules imports torch; a value
# the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
