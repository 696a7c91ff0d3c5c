"""mooncaked.coord: coordination. Leased membership and the conductor's election over a
local state directory (local.py) or etcd (etcd.py), on the `Coordinator` base
(coordinator.py) and its records (records.py); the embedded etcd server (etcd_server.py).

    coord = make_coordinator(settings.cluster)       # LocalCoordinator | EtcdCoordinator
    async with coord:
        await coord.register(node_id, {"api": "127.0.0.1:8000", "role": "prefill"})
        leadership = await coord.campaign(node_id)   # returns once elected
        await leadership.wait_lost()
"""
