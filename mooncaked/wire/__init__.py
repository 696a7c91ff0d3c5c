"""mooncaked.wire: the contract between nodes, the only floor that cluster/, conductor/
and store/ share: typed messages (messages.py), node-to-node control RPC with streaming
(rpc.py), the cluster token (auth.py) and the errors (errors.py).

    server = ControlServer(); server.add_handler("drain", drain)
    app.add_routes(server.routes())                  # or: await server.start(host, port)
    result = await ControlClient(timeout_s=5).call("127.0.0.1:8001", "drain", {...})
"""
