"""make_coordinator: the coordinator of a cluster's settings. Outside the base
(coordinator.py), so the base does not import its own subclasses."""

from __future__ import annotations

from mooncaked.config import ClusterSettings, ConfigError

from .coordinator import Coordinator
from .local import LocalCoordinator


def make_coordinator(settings: ClusterSettings) -> Coordinator:
    """The coordinator of settings.backend ("local" or "etcd"), not yet started.

    Raises: ConfigError for bad settings (e.g. heartbeat too slow for the TTL, an unknown
    backend).
    """
    if settings.backend == "local":
        return LocalCoordinator(settings)
    if settings.backend == "etcd":
        # Lazy: aetcd + grpc take about 0.4 s to import, and only this backend needs them.
        from .etcd import EtcdCoordinator  # noqa: PLC0415
        return EtcdCoordinator(settings)
    raise ConfigError("<settings>", "cluster.backend", f"unknown backend {settings.backend!r}")


__all__ = ["make_coordinator"]
