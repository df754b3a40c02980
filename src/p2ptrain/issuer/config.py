"""The issuing service's configuration file (TOML): its policy and its connectors.

::

    lifetime = "30d"                 # how long a certificate is valid
    roles = ["trainer"]              # the roles certificates allow (default: any)
    max_keys_per_subject = 2         # node keys one person may hold certificates for
    allow = ["github:alice"]         # subjects let in (default: everyone who signs in)
    allow_groups = ["my-org", "my-org/core"]   # GitHub organisations and teams let in
    renew = "while-valid"            # or "sign-in": every renewal needs a new sign-in

    [[connectors]]
    kind = "oidc"                    # OpenID Connect, found by its discovery document
    name = "company"
    issuer = "https://login.example.com"
    client_id = "p2ptrain"
    client_secret_file = "oidc.secret"   # optional: a public client uses PKCE alone

    [[connectors]]
    kind = "github"
    client_id = "Iv1.0123456789"
    client_secret_file = "github.secret"

    [[connectors]]
    kind = "oauth2"
    name = "forge"
    authorize_url = "https://forge.example.com/oauth/authorize"
    token_url = "https://forge.example.com/oauth/token"
    userinfo_url = "https://forge.example.com/api/user"
    subject_field = "username"       # the user-info field that names the person
    client_id = "..."

    [[connectors]]
    kind = "trusted-ingress"
    name = "sso-proxy"
    header = "X-Forwarded-User"
    proxies = ["10.0.0.2"]           # the only addresses whose header is believed

Relative secret files are read from the configuration file's folder.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Final

from p2ptrain.core.roles import ROLES
from p2ptrain.errors import LocalError
from p2ptrain.issuer.connectors import (
    Connector,
    GitHubConnector,
    OAuth2Connector,
    OidcConnector,
    TrustedIngress,
)
from p2ptrain.issuer.policy import Policy

__all__ = ["KINDS", "load_config", "parse_duration_s"]

KINDS: Final = ("oidc", "oauth2", "github", "trusted-ingress")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_POLICY_KEYS = {
    "lifetime",
    "roles",
    "max_keys_per_subject",
    "allow",
    "allow_groups",
    "renew",
    "connectors",
}


def parse_duration_s(text: str, where: str) -> float:
    match = _DURATION.fullmatch(str(text).strip())
    if match is None or float(match.group(1)) <= 0:
        raise LocalError(
            f"{where} {text!r:.80}: use a duration such as 90d, 12h, 30m or 45s"
            + (", or never" if where == "--expires" else "")
        )
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise LocalError(f"{where}: a list of strings")
    return list(value)


def _secret(entry: dict[str, Any], folder: Path, where: str) -> str | None:
    name = entry.pop("client_secret_file", None)
    if name is None:
        return None
    path = folder / str(name)
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise LocalError(f"{where}: cannot read client_secret_file {path}: {exc}") from exc


def _connector(entry: dict[str, Any], folder: Path, index: int) -> Connector:
    entry = dict(entry)
    kind = entry.pop("kind", None)
    where = f"connectors[{index}]"
    if kind not in KINDS:
        raise LocalError(f"{where}.kind {kind!r}: choose from {', '.join(KINDS)}")
    name = str(entry.pop("name", kind))
    where = f"connector {name!r} ({kind})"
    try:
        if kind == "trusted-ingress":
            return TrustedIngress(
                name,
                header=str(entry.pop("header", "X-Forwarded-User")),
                proxies=frozenset(_strings(entry.pop("proxies", []), f"{where}: proxies")),
                prefix=str(entry.pop("prefix", "ingress")),
            )
        secret = _secret(entry, folder, where)
        if kind == "oidc":
            return OidcConnector(name, client_secret=secret, **entry)
        if kind == "github":
            return GitHubConnector(name, client_secret=secret, **entry)
        return OAuth2Connector(name, client_secret=secret, **entry)
    except TypeError as exc:  # a missing or unknown key
        raise LocalError(f"{where}: {exc}; see `p2ptrain issuer --help` for its keys") from exc


def load_config(path: Path) -> tuple[Policy, list[Connector]]:
    """The policy and connectors in the configuration file ``path``."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LocalError(f"cannot read the issuer's configuration {path}: {exc}") from exc
    unknown = sorted(set(data) - _POLICY_KEYS)
    if unknown:
        raise LocalError(
            f"{path}: unknown settings {', '.join(unknown)}; known: "
            f"{', '.join(sorted(_POLICY_KEYS))}"
        )
    roles = tuple(sorted(set(_strings(data.get("roles", []), f"{path}: roles"))))
    wrong = [role for role in roles if role not in ROLES]
    if wrong:
        raise LocalError(f"{path}: roles {', '.join(wrong)}: choose from {', '.join(ROLES)}")
    renew = data.get("renew", "while-valid")
    if renew not in ("while-valid", "sign-in"):
        raise LocalError(f"{path}: renew {renew!r}: 'while-valid' or 'sign-in'")
    limit = data.get("max_keys_per_subject", 2)
    if not isinstance(limit, int) or limit < 1:
        raise LocalError(f"{path}: max_keys_per_subject {limit!r}: a whole number, 1 or more")
    policy = Policy(
        lifetime_s=parse_duration_s(data.get("lifetime", "30d"), f"{path}: lifetime"),
        roles=roles,
        max_keys_per_subject=limit,
        allow_subjects=frozenset(_strings(data.get("allow", []), f"{path}: allow")),
        allow_groups=frozenset(_strings(data.get("allow_groups", []), f"{path}: allow_groups")),
        renew=renew,
    )
    entries = data.get("connectors", [])
    if not isinstance(entries, list) or not entries:
        raise LocalError(f"{path}: no [[connectors]]: name at least one way to sign in")
    connectors = [_connector(entry, path.parent, i) for i, entry in enumerate(entries)]
    names = [connector.name for connector in connectors]
    if len(set(names)) != len(names):
        raise LocalError(f"{path}: two connectors share a name ({', '.join(names)}); name them")
    return policy, connectors
