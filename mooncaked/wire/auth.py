"""The cluster secret: every control call (node to node, `mooncake ctl`) and every
internal decode stream carries it, and a node refuses calls without it.

The secret is a token in a file that every node and operator of one cluster can read
(cluster.token_file; mode 0600, owned by the service user). With the local backend and
no token_file, the first node creates `<cluster state dir>/token` (the directory the
nodes of a one-host cluster already share); the etcd backend needs an explicit
token_file, the same on every host. Calls send it as `Authorization: Bearer <token>`;
servers compare it in constant time (hmac.compare_digest) and log refusals (rate
limited per peer).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from mooncaked.config import ClusterSettings, ConfigError, cluster_state_dir
from mooncaked.log import get_logger
from mooncaked.lograte import RateLimitedLog

log = get_logger(__name__)
_refusals = RateLimitedLog(log)

HEADER = "Authorization"
SCHEME = "Bearer "
TOKEN_BYTES = 32          # 256 bits from secrets.token_urlsafe
MIN_TOKEN_CHARS = 16      # shorter tokens are refused as guessable


def token_path(settings: ClusterSettings) -> Path:
    """Where this cluster's token lives: cluster.token_file, else (local backend) the
    cluster state directory's `token`. Raises: ConfigError for etcd without token_file."""
    if settings.token_file:
        return Path(settings.token_file).expanduser()
    if settings.backend == "local":
        return cluster_state_dir(settings) / "token"
    raise ConfigError("<settings>", "cluster.token_file",
                      "required with the etcd backend: a file holding the cluster's shared "
                      "secret, the same on every node (create one with "
                      "`mooncaked token --out FILE`)")


def new_token() -> str:
    """A fresh random token (URL-safe text)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def write_token_file(path: Path) -> str:
    """Creates path (mode 0600) holding a new token, unless it exists; returns the token
    in the file. Raises: OSError when it cannot be created or read."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    token = new_token()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def load_token(settings: ClusterSettings, create: bool = False) -> str:
    """The cluster's token. With create (a node of the local backend), makes the default
    token file when it does not exist yet.

    Raises: ConfigError naming cluster.token_file when the file is missing, unreadable
    or too short.
    """
    path = token_path(settings)
    try:
        if create and not settings.token_file:
            token = write_token_file(path)
        else:
            token = path.read_text().strip()
    except OSError as e:
        raise ConfigError("<settings>", "cluster.token_file",
                          f"cannot read the cluster token {path}: {e.strerror or e}") from e
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError("<settings>", "cluster.token_file",
                          f"{path}: the token must be at least {MIN_TOKEN_CHARS} characters")
    try:
        if path.stat().st_mode & 0o004:
            log.warning("cluster_token_world_readable", path=str(path),
                        fix=f"chmod o-r {path}")
    except OSError:
        pass
    return token


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a call carries ({} without a token)."""
    return {HEADER: SCHEME + token} if token else {}


def authorized(headers, token: str | None, peer: str | None, what: str) -> bool:
    """True when the request's Authorization header carries token (constant-time
    comparison); a refusal is logged (at most once per peer per window). token None:
    no authentication (unit tests of the RPC layer only)."""
    if token is None:
        return True
    got = headers.get(HEADER, "")
    ok = got.startswith(SCHEME) and hmac.compare_digest(got[len(SCHEME):].encode(),
                                                       token.encode())
    if not ok:
        _refusals.warning(f"refused:{peer}", "control_call_refused", peer=peer, call=what,
                          reason="no cluster token" if not got else "wrong cluster token")
    return ok


__all__ = ["auth_headers", "authorized", "load_token", "new_token", "token_path",
           "write_token_file", "HEADER"]
