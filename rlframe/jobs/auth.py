"""Where the job client finds the dashboard address and Ray's authentication token.

Ray 2.60 turns token authentication on by default: `ray.init()` writes a random token to
`~/.ray/auth_token` and a later `ray start --head` that finds that file runs in token mode. The
dashboard then answers 401 to job-API requests without `Authorization: Bearer <token>`.

Ray's own `JobSubmissionClient` adds that header only when the *client process* is in token mode
(`RAY_AUTH_MODE=token` in its environment), which a notebook usually is not. So the client here
reads the token itself, in the order Ray's C++ token loader uses, and passes the header explicitly:

1. `RAY_AUTH_TOKEN` (the token itself),
2. `RAY_AUTH_TOKEN_PATH` (a file holding it),
3. `~/.ray/auth_token` (the file `ray.init()` / `ray get-auth-token --generate` writes).

Sending a token to a cluster without authentication is harmless (its dashboard ignores the header).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def default_token_path() -> Path:
    """~/.ray/auth_token, read at call time (HOME may change, e.g. in tests)."""
    return Path.home() / ".ray" / "auth_token"


def resolve_address(address: str | None) -> str:
    """The dashboard URL: `address`, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS, else 127.0.0.1:8265.

    A bare `host:port` gets `http://`. RAY_ADDRESS is used only when it is an http URL because it
    usually names the GCS (`host:6379`), which does not serve the job API.
    """
    if not address:
        env_addr = os.environ.get("RAY_ADDRESS", "")
        address = os.environ.get("RAY_API_SERVER_ADDRESS") or (env_addr if env_addr.startswith("http") else "")
    address = (address or DEFAULT_ADDRESS).rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    return address


def find_token(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(token or None, where it came from) following Ray's lookup order (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return env["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    for where, path in (("RAY_AUTH_TOKEN_PATH", env.get("RAY_AUTH_TOKEN_PATH")), ("default", str(default_token_path()))):
        if path and Path(path).expanduser().is_file():
            token = Path(path).expanduser().read_text().strip()
            if token:
                return token, f"{where} file {path}"
    return None, "nowhere (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token are all unset or empty)"


def auth_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """{"Authorization": "Bearer <token>"} when a token is found, else {}."""
    token, _ = find_token(env)
    return {"Authorization": f"Bearer {token}"} if token else {}


def authentication_mode(address: str, *, timeout_s: float = 5.0) -> str:
    """The cluster's mode ("token" or "disabled") from its public /api/authentication_mode endpoint.

    "unknown" when the server answers without that endpoint (an older Ray); raises
    requests.RequestException only when nothing answers at `address`.
    """
    import requests

    reply = requests.get(f"{address}/api/authentication_mode", timeout=timeout_s)
    if reply.status_code != 200:
        return "unknown"
    try:
        return str(reply.json().get("authentication_mode", "unknown"))
    except ValueError:
        return "unknown"
