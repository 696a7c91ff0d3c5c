"""mooncaked.cluster: coordination (local or etcd backend), leased membership, conductor
election, and node-to-node control RPC.

    coord = make_coordinator(settings.cluster)       # LocalCoordinator | EtcdCoordinator
    async with coord:
        await coord.register(node_id, {"api": "127.0.0.1:8000", "role": "prefill"})
        leadership = await coord.campaign(node_id)   # returns once elected
        await leadership.wait_lost()

    server = ControlServer(); server.add_handler("drain", drain)
    app.add_routes(server.routes())                  # or: await server.start(host, port)
    result = await ControlClient(timeout_s=5).call("127.0.0.1:8001", "drain", {...})
"""

from .coordinator import (DEFAULT_ELECTION, Coordinator, Leadership, Member, MemberEvent,
                          default_state_dir, make_coordinator)
from .errors import (ClusterError, CoordinationError, PeerUnavailable, RpcError, RpcTimeout,
                     SessionLost)
from .rpc import ControlClient, ControlServer

__all__ = ["Coordinator", "Member", "MemberEvent", "Leadership", "make_coordinator",
           "default_state_dir", "DEFAULT_ELECTION", "ControlServer", "ControlClient",
           "ClusterError", "CoordinationError", "SessionLost", "RpcError", "PeerUnavailable",
           "RpcTimeout"]
