"""mooncaked: a KVCache-centric, disaggregated LLM serving daemon (after Mooncake, FAST'25)."""

__version__ = "0.1.0"
