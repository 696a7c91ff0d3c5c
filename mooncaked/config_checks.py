"""Cross-field checks of a whole Settings: what one key alone cannot say (a heartbeat
slower than half the lease, an etcd cluster without a shared token, half a TLS key
pair). `load_settings` runs them, so `mooncaked serve` and `mooncaked config --check`
refuse the same files with the same one-line ConfigError (file, key, reason), defined
here so that config.py imports this module and not the other way round."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # annotations only: config.py imports this module
    from mooncaked.config import Settings

CLUSTER_ROLES = ("prefill", "decode", "cache")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")      # the torch devices the engine runs on


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type or out of range.

    Attributes: `path` (the file, or "<flags>"), `key` (dotted, e.g.
    "engine.block_size"; "" for the whole file: unreadable, not TOML) and `reason`.
    """

    def __init__(self, path: str, key: str, reason: str):
        super().__init__(f"{path}: {key}: {reason}" if key else f"{path}: {reason}")
        self.path, self.key, self.reason = path, key, reason


def check_settings(settings: Settings, where: str) -> None:
    """Raises ConfigError(where, key, reason) for the first cross-field problem."""
    if not DEVICE.fullmatch(settings.model.device):
        raise ConfigError(where, "model.device",
                          f"{settings.model.device!r}: expected cpu, cuda or cuda:N")
    cs = settings.cluster
    if cs.heartbeat_interval_s * 2 > cs.lease_ttl_s:
        raise ConfigError(where, "cluster.heartbeat_interval_s",
                          f"{cs.heartbeat_interval_s} s must be at most half of "
                          f"cluster.lease_ttl_s ({cs.lease_ttl_s} s)")
    if cs.backend == "etcd":
        if not cs.etcd_endpoints:
            raise ConfigError(where, "cluster.etcd_endpoints", "empty list")
        for url in cs.etcd_endpoints:
            parts = urlsplit(url if "://" in url else f"http://{url}")
            if parts.scheme not in ("http", "https"):
                raise ConfigError(where, "cluster.etcd_endpoints",
                                  f"{url!r}: expected http:// or https://HOST:PORT")
            if not parts.hostname or not parts.port:
                raise ConfigError(where, "cluster.etcd_endpoints",
                                  f"{url!r}: expected http(s)://HOST:PORT")
        if settings.node.role in CLUSTER_ROLES and not cs.token_file:
            raise ConfigError(where, "cluster.token_file",
                              "required with the etcd backend (the cluster's shared secret, "
                              "the same file content on every node; `mooncaked token --out FILE`)")
    if bool(cs.etcd_cert_file) != bool(cs.etcd_key_file):
        key = "cluster.etcd_key_file" if cs.etcd_cert_file else "cluster.etcd_cert_file"
        raise ConfigError(where, key, "etcd_cert_file and etcd_key_file go together")
    cpp = settings.cpp
    if cpp.group and cpp.stage >= cpp.stages:
        raise ConfigError(where, "cpp.stage", f"{cpp.stage} is not below cpp.stages ({cpp.stages})")
    if cpp.layer_weights and (len(cpp.layer_weights) != cpp.stages
                              or any(w <= 0 for w in cpp.layer_weights)):
        raise ConfigError(where, "cpp.layer_weights",
                          f"expected {cpp.stages} positive shares (cpp.stages), got "
                          f"{cpp.layer_weights}")
    if settings.server.port and cs.rpc_port and settings.server.port == cs.rpc_port \
            and settings.server.host == cs.rpc_host:
        raise ConfigError(where, "cluster.rpc_port",
                          f"{cs.rpc_port} is also server.port: the control plane listens apart "
                          f"from the public API")


__all__ = ["check_settings", "CLUSTER_ROLES", "ConfigError"]
