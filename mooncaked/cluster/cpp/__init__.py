"""mooncaked.cluster.cpp: chunked pipeline parallelism (paper section 3.3). One stage
server per process holds a range of layers (pipeline_stage.py), the cluster's CPP worker
drives a group of them (cpp_node.py), and each stage keeps its prefix in the store
(stage_prefix.py)."""
