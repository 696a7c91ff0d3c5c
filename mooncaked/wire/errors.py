"""Errors of the coordination layer and the node-to-node control RPC."""

from __future__ import annotations


class ClusterError(Exception):
    """Base class of every error raised by mooncaked.cluster."""


class CoordinationError(ClusterError):
    """The coordination store (etcd, or the local state directory) failed or is unreachable.

    Raised by Coordinator operations after their `op_timeout_s`; the message names
    the backend and the endpoint or directory.
    """


class SessionLost(CoordinationError):
    """This process's lease expired (or was revoked) before the operation finished.

    Ephemeral keys and leadership held through it are gone; the coordinator opens a
    new session on its next heartbeat and re-registers the node.
    """


class RpcError(ClusterError):
    """A control call failed.

    Attributes: `peer` (address called), `method` (handler name), `remote_type`
    (the exception class name raised by the remote handler, or "" when the failure
    was local or in transport), `remote_message` (its message, as the handler wrote
    it), `remote_param` (the request parameter at fault, if the error named one),
    `status` (the HTTP status of the answer, 0 when there was none) and `body` (the JSON
    object of an error answer, {} when it was none: a stream route's 429 carries its
    refusal there, "reason", "retry_after_s", "predicted_tbt_s"), `remote_detail` (a
    control handler's error detail, e.g. DecodeRefused's refusal; None when it gave none).
    """

    def __init__(self, message: str, *, peer: str = "", method: str = "", remote_type: str = "",
                 remote_message: str = "", remote_param: str | None = None, status: int = 0,
                 body: dict | None = None, remote_detail: dict | None = None):
        super().__init__(message)
        self.peer, self.method, self.remote_type = peer, method, remote_type
        self.remote_message, self.remote_param, self.status = remote_message, remote_param, status
        self.body = body if body is not None else {}
        self.remote_detail = remote_detail


class NotLeader(RuntimeError):
    """This node does not run the conductor (any more); ask the current leader.

    Raised by a node's conductor calls when no leader is known or the callee is not it any
    more; it crosses the wire as an RpcError whose remote_type is "NotLeader".
    """


class DecodeRefused(ClusterError):
    """A decode node's TBT admission check refused a request (cluster/admission.py) when
    the prefill node asked it to admit the request, before the prefill computed.

    `detail` is the refusal ({"error", "reason", "predicted_tbt_s", "tbt_slo_s",
    "retry_after_s"}); a control handler that raises it answers HTTP 429 with the detail,
    which arrives as RpcError.remote_detail (remote_type "DecodeRefused")."""

    http_status = 429

    def __init__(self, message: str, detail: dict):
        super().__init__(message)
        self.detail = detail


class PeerUnavailable(RpcError):
    """The peer could not be reached: connection refused or reset, or it died mid-call."""


class NotConnected(PeerUnavailable):
    """No connection to the peer could be opened (refused, unreachable): the peer never saw
    the call, so sending it to another node cannot do anything twice."""


class BadReply(RpcError):
    """The peer's answer breaks the wire format: not JSON, no "ok", a stream line that is
    not a JSON value, or larger than the client's bound."""


class RpcTimeout(RpcError):
    """The peer did not answer within the call's timeout (seconds)."""


__all__ = ["ClusterError", "CoordinationError", "SessionLost", "RpcError", "PeerUnavailable",
           "NotConnected", "BadReply", "RpcTimeout", "NotLeader", "DecodeRefused"]
