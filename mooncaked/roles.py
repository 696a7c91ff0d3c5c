"""What each node role uses of the settings, so that a setting it ignores is warned about.

`mooncaked serve --role R` reads one settings file for every role; a section the
role never reads (the `all` role has no coordinator, transfer engine or
conductor; a `cache` node runs no engine) would otherwise be silently ignored.
`unused_settings` lists the keys set away from their defaults in such sections;
the daemon logs them at start (`settings_unused`). The `all` and `prefill` roles
offload finished requests' KV into their `[store]` as configured; `decode` does
unless `store.decode_offload` is false.
"""

from __future__ import annotations

import dataclasses

from mooncaked.config import Settings

UNUSED_SECTIONS: dict[str, tuple[str, ...]] = {
    "all": ("cluster", "transfer", "conductor", "cpp"),
    "prefill": (),
    "decode": ("cpp",),
    "cache": ("engine", "cpp"),
}
"""Sections of Settings that a role never reads."""

STORE_ROLES = ("all", "prefill", "decode")
"""Roles whose engine offloads finished requests' KV blocks into the node's store
(decode unless store.decode_offload is false)."""


def unused_settings(settings: Settings) -> list[str]:
    """Dotted keys ("cluster.backend") that differ from their defaults in sections
    `settings.node.role` never reads, sorted. Unknown roles read everything."""
    out = []
    role = settings.node.role
    if role == "all" and settings.cluster.coupled:
        return out      # a coupled `all` node joins the cluster: it reads every section
    for section in UNUSED_SECTIONS.get(role, ()):
        value = getattr(settings, section)
        default = type(value)()
        for f in dataclasses.fields(value):
            if getattr(value, f.name) != getattr(default, f.name):
                out.append(f"{section}.{f.name}")
    return sorted(out)
