"""A real OpenID provider on loopback for the issuer's tests, and a person at a browser.

:class:`OidcProvider` runs panva's ``oidc-provider`` (``make test`` installs it with npm into
``build/oidc``; :func:`provider_unavailable` says why a test must skip without it) through
``tests/support/oidc_provider.mjs``, which prints the issuer URL once it answers.

:func:`log_in` and :func:`enter_device_code` do what a person does in a browser: follow the
sign-in link (or open the device page and enter the code), sign in at the provider's login
form as ``login`` and grant consent. The provider's development interactions accept any
login name as the account (the ID token's ``sub``).
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import TracebackType
from urllib.parse import urljoin

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / "build" / "oidc"
SCRIPT = Path(__file__).with_name("oidc_provider.mjs")
NATIVE_CLIENT = "p2ptrain-native"
WEB_CLIENT = "p2ptrain-web"
WEB_SECRET = "p2ptrain-web-secret"


def provider_unavailable() -> str | None:
    if shutil.which("node") is None:
        return "the OpenID provider needs node (make test installs nodejs and npm)"
    if not (MODULES / "node_modules" / "oidc-provider" / "package.json").exists():
        return f"oidc-provider is not installed in {MODULES} (make oidc-provider)"
    return None


class OidcProvider:
    """``oidc-provider`` on 127.0.0.1 (a port of its own), for a ``with`` block."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.issuer = ""
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> OidcProvider:
        self._process = subprocess.Popen(
            ["node", str(SCRIPT), str(MODULES)],
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        assert self._process.stdout is not None
        for line in self._process.stdout:
            with contextlib.suppress(ValueError):
                told = json.loads(line)
                if isinstance(told, dict) and "issuer" in told:
                    self.issuer = str(told["issuer"])
                    break
        if not self.issuer:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the OpenID provider did not start: see {self.log}")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


_INPUT = re.compile(r"<input([^>]*)>", re.IGNORECASE)
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')
_FORM = re.compile(r"<form([^>]*)>(.*?)</form>", re.IGNORECASE | re.DOTALL)


def _forms(page: str) -> list[tuple[dict[str, str], dict[str, str]]]:
    """Each form's attributes and the values of its named inputs."""
    forms = []
    for attributes, body in _FORM.findall(page):
        inputs = {}
        for raw in _INPUT.findall(body):
            found = {k.lower(): html.unescape(v) for k, v in _ATTRIBUTE.findall(raw)}
            if "name" in found:
                inputs[found["name"]] = found.get("value", "")
        forms.append(
            ({k.lower(): html.unescape(v) for k, v in _ATTRIBUTE.findall(attributes)}, inputs)
        )
    return forms


async def _interact(
    http: aiohttp.ClientSession, answer: aiohttp.ClientResponse, login: str
) -> tuple[int, str]:
    """Sign in as ``login`` and consent, from ``answer`` (a provider page) on."""
    for _ in range(6):
        page = await answer.text()
        forms = [
            (attributes, inputs)
            for attributes, inputs in _forms(page)
            if inputs.get("prompt") in ("login", "consent")
        ]
        if not forms:
            return answer.status, page
        attributes, inputs = forms[0]
        if inputs["prompt"] == "login":
            inputs.update(login=login, password="any")
        action = urljoin(str(answer.url), attributes.get("action", str(answer.url)))
        answer = await http.post(action, data=inputs)
    raise AssertionError(f"the provider kept asking: {page[:500]}")


async def log_in(url: str, login: str) -> tuple[int, str]:
    """Open the sign-in link ``url`` and sign in as ``login``: the final page's status and
    text (the issuer's page)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        answer = await http.get(url)
        return await _interact(http, answer, login)


async def enter_device_code(verification_uri_complete: str, login: str) -> tuple[int, str]:
    """Open the device page with its code, confirm it, sign in as ``login`` and consent: the
    provider's final page."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        answer = await http.get(verification_uri_complete)
        page = await answer.text()
        for attributes, inputs in _forms(page):
            if "xsrf" in inputs:
                inputs["confirm"] = "yes"
                action = urljoin(str(answer.url), attributes.get("action", ""))
                answer = await http.post(action, data=inputs)
                return await _interact(http, answer, login)
        raise AssertionError(f"no code form on the device page: {page[:500]}")
