"""mooncaked.cluster: the node roles of a cluster (the node, its front end, membership,
the prefill and decode workers, the KV push, the prefill queue, admission) and CPP
(`cluster.cpp`: chunked pipeline parallelism's stage servers).

The wire contract these roles speak lives in `mooncaked.wire` (messages, RPC, auth,
errors); coordination (leased membership, the conductor's election, the local and etcd
backends) in `mooncaked.coord`.
"""
