"""Image URLs in inference requests: fetched by the HTTP front (heron.runtime.front) of
``heron serve``, a worker's own API and the gateway, from the hosts the operator allows,
before the work is computed or published; a worker gets the bytes exactly as if they had
been sent inline.

Off by default: a server that fetches what a request names can be pointed at internal
addresses (SSRF: cloud metadata, admin ports). ``--image-url-hosts`` /
``HERON_IMAGE_URL_HOSTS`` (heron.runtime.settings) lists the hosts: exact names or IP
literals, or ``*.example.com`` for any name under example.com (not example.com itself),
every port. What holds:

- A URL's host is checked before anything is sent; a host not on the list is never looked
  up or connected to (422 IMAGE_URL_REFUSED naming it). Every URL of a request is checked
  before any is fetched. The URL is parsed once, by httpx, and that parse is what is
  fetched: no second parser to disagree about the host. Credentials in a URL are refused.
- Redirects (at most ``MAX_REDIRECTS``) are followed only to http(s) URLs whose host is on
  the list, each checked as above (422 IMAGE_URL_REFUSED otherwise).
- Only a 2xx answer is an image; any other status, a connection failure, a TLS failure or
  the timeout (``--image-url-timeout-s``: one bound on fetching all of a request's images,
  redirects and bodies included) is 422 IMAGE_FETCH_FAILED naming ``items[i].image``. A
  request's own ``timeout_s``, when it ends sooner, ends the fetch with 504
  DEADLINE_EXCEEDED. One URL that fails fails the request, and its other fetches stop.
- The body is read as it streams and cut at MAX_IMAGE_BYTES (413 IMAGE_TOO_LARGE), and the
  images of one request at the front's body limit in all (413 PAYLOAD_TOO_LARGE), so a
  request of URLs holds no more memory than one that sends its images inline.
- At most ``MAX_FETCHES_PER_REQUEST`` fetches of one request at once, ``MAX_CONNECTIONS``
  in the process; proxies and .netrc from the environment are not used.

The allowlist is the operator's explicit trust: a listed loopback or private host is
fetched, and a listed name is fetched wherever DNS says it is.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import httpx

from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.images import MAX_IMAGE_BYTES
from heron_sdk.types import MAX_BODY_BYTES, EncodeRequest, ScoreRequest

if TYPE_CHECKING:
    from heron.runtime.backend import InferenceCall

log = logging.getLogger("heron.image_urls")

HOSTS_SETTING = "--image-url-hosts / HERON_IMAGE_URL_HOSTS"
DEFAULT_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
MAX_FETCHES_PER_REQUEST = 8
MAX_CONNECTIONS = 64  # fetches in flight in the process, all requests together
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity"}
_LABEL = re.compile(r"[a-z0-9_-]{1,63}")  # one label of a host name, lowercased


def _normal_host(host: str) -> str:
    """A host as the list compares it: lowercased, without a trailing dot or brackets; an
    IP address in its canonical form (``0:0::1`` is ``::1``)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host[:-1] if host.endswith(".") else host


class HostAllowlist:
    """The hosts image URLs may be fetched from: exact names and IP literals, and
    ``*.suffix`` entries that match any name ending in ``.suffix``. Empty: none."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.exact: frozenset[str] = frozenset()
        self.suffixes: tuple[str, ...] = ()
        exact, suffixes = set(), []
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            wildcard = entry.startswith("*.")
            host = _normal_host(entry[2:] if wildcard else entry)
            if not _is_host(host) or (wildcard and _is_ip(host)):
                raise ValueError(f"{raw.strip()!r} is not a host name, an IP address or "
                                 "*.domain (hosts only: no scheme, port or path; * alone "
                                 "would allow every host)")
            if wildcard:
                suffixes.append("." + host)
            else:
                exact.add(host)
        self.exact, self.suffixes = frozenset(exact), tuple(suffixes)

    @classmethod
    def parse(cls, text: str | None) -> HostAllowlist:
        """From the setting's text: comma-separated entries (ValueError for a bad one)."""
        return cls((text or "").split(","))

    def __bool__(self) -> bool:
        return bool(self.exact or self.suffixes)

    def allows(self, host: str) -> bool:
        host = _normal_host(host)
        if not host:
            return False
        if host in self.exact:
            return True
        return not _is_ip(host) and any(host.endswith(s) for s in self.suffixes)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_host(host: str) -> bool:
    return 0 < len(host) <= 253 and (
        _is_ip(host) or all(_LABEL.fullmatch(label) for label in host.split(".")))


def _refused(field: str, why: str) -> HeronError:
    return HeronError(ErrorCode.IMAGE_URL_REFUSED, f"{field}: {why}", field=field)


def _failed(field: str, why: str) -> HeronError:
    return HeronError(ErrorCode.IMAGE_FETCH_FAILED, f"{field}: {why}", field=field)


class ImageFetcher:
    """Puts the bytes of a parsed request's image URLs in their place (``fetch``), from
    the allowed hosts; one per front. Its HTTP client is made on first use, one per event
    loop, and closed by ``aclose``."""

    def __init__(self, hosts: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_total_bytes: int = MAX_BODY_BYTES, user_agent: str = "heron") -> None:
        self.allowlist = HostAllowlist.parse(hosts)
        self.timeout_s = timeout_s
        self.max_total_bytes = max_total_bytes
        self.user_agent = user_agent
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def pending(req: EncodeRequest | ScoreRequest) -> bool:
        """Whether ``req`` holds image URLs (cheap: the parser's items, once)."""
        return ((isinstance(req, ScoreRequest) and req.query_image_url is not None)
                or any(item.image_url is not None for item in req.items))

    async def fetch(self, req: EncodeRequest | ScoreRequest, call: InferenceCall) -> float:
        """Replace every image URL of ``req`` with its bytes (the item's or the query's
        place); the seconds it took. Every URL is checked before any is fetched, and a URL
        given several times is fetched once."""
        urls = [(f"items[{n}].image", item.image_url) for n, item in enumerate(req.items)
                if item.image_url is not None]
        if isinstance(req, ScoreRequest) and req.query_image_url is not None:
            urls.insert(0, ("query.image", req.query_image_url))
        if not urls:
            return 0.0
        started = time.monotonic()
        checked: dict[str, tuple[str, httpx.URL]] = {}  # one fetch per distinct URL
        for field, url in urls:
            parsed = self.check(url, field)
            checked.setdefault(url, (field, parsed))
        limit, by_deadline = self.timeout_s, False
        if req.options.timeout_s is not None:
            remaining = call.remaining_s(req.options.timeout_s)
            if remaining < limit:
                limit, by_deadline = max(0.0, remaining), True
        budget = [self.max_total_bytes]  # bytes the request's images may still take
        gate = asyncio.Semaphore(MAX_FETCHES_PER_REQUEST)
        tasks = [asyncio.ensure_future(self._fetch_one(parsed, field, limit, by_deadline, gate,
                                                       budget))
                 for field, parsed in checked.values()]
        try:
            images = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        found = dict(zip(checked, images, strict=True))  # URL -> bytes
        if isinstance(req, ScoreRequest) and req.query_image_url is not None:
            req.query_image, req.query_image_url = found[req.query_image_url], None
        for n, item in enumerate(req.items):
            if item.image_url is not None:
                req.items[n] = replace(item, image=found[item.image_url], image_url=None)
        return time.monotonic() - started

    def check(self, url: str | httpx.URL, field: str) -> httpx.URL:
        """``url`` parsed, when it may be fetched; else 422 IMAGE_URL_REFUSED naming why."""
        if not self.allowlist:
            raise _refused(field, "this server does not fetch image URLs (a server that "
                           "fetches what a request names can be pointed at internal "
                           "addresses; its operator may allow hosts with "
                           f"{HOSTS_SETTING}); send the image's bytes as base64")
        try:
            parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise _refused(field, f"not a URL this server can fetch ({exc})") from None
        if parsed.scheme not in ("http", "https"):
            raise _refused(field, f"only http and https URLs are fetched, not {parsed.scheme}")
        if parsed.userinfo:
            raise _refused(field, "a URL with credentials (user:password@) is not fetched")
        host = parsed.raw_host.decode("ascii", "replace")
        if not self.allowlist.allows(host):
            raise _refused(field, f"host {host[:253]!r} is not one this server fetches images "
                                  f"from ({HOSTS_SETTING})")
        return parsed

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._loop = loop
            self._client = httpx.AsyncClient(
                follow_redirects=False, trust_env=False,
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=MAX_CONNECTIONS,
                                    max_keepalive_connections=16),
                headers={**_HEADERS, "User-Agent": self.user_agent})
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _fetch_one(self, url: httpx.URL, field: str, limit: float, by_deadline: bool,
                         gate: asyncio.Semaphore, budget: list[int]) -> bytes:
        started = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                async with gate:
                    return await self._follow(url, field, budget)
        except TimeoutError:
            if by_deadline:
                raise HeronError(ErrorCode.DEADLINE_EXCEEDED,
                                 f"{field}: timeout_s passed while fetching the image from "
                                 f"{url.host}", field=field) from None
            raise _failed(field, f"the image from {url.host} did not arrive within "
                                 f"{self.timeout_s:g} s (--image-url-timeout-s)") from None
        except httpx.HTTPError as exc:  # connection refused or reset, DNS, TLS, protocol
            raise _failed(field, f"fetching from {url.host} failed: "
                                 f"{type(exc).__name__}{f': {exc}' if str(exc) else ''}"
                          ) from None
        finally:
            log.debug("image fetch %s: %s in %.3f s", field, url.host,
                      time.monotonic() - started)

    async def _follow(self, url: httpx.URL, field: str, budget: list[int]) -> bytes:
        client = self._http()
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    try:
                        url = self.check(url.join(response.headers["location"]), field)
                    except httpx.InvalidURL as exc:
                        raise _failed(field, f"{url.host} redirected to a bad URL ({exc})"
                                      ) from None
                    continue
                if not response.is_success:
                    raise _failed(field, f"{url.host} answered HTTP {response.status_code}")
                return await self._read(response, url, field, budget)
        raise _failed(field, f"more than {MAX_REDIRECTS} redirects")

    async def _read(self, response: httpx.Response, url: httpx.URL, field: str,
                    budget: list[int]) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
            raise _too_large(field, url, f"{int(declared)} bytes")
        parts, size = [], 0
        async for part in response.aiter_bytes():
            size += len(part)
            if size > MAX_IMAGE_BYTES:
                raise _too_large(field, url, f"more than {MAX_IMAGE_BYTES} bytes")
            budget[0] -= len(part)
            if budget[0] < 0:
                raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                                 f"{field}: the images fetched for this request come to more "
                                 f"than {self.max_total_bytes} bytes (the body limit); send "
                                 "fewer per request", field=field)
            parts.append(part)
        if not size:
            raise HeronError(ErrorCode.IMAGE_INVALID, f"{field}: the image at {url.host} is "
                             "empty", field=field)
        return b"".join(parts)


def _too_large(field: str, url: httpx.URL, size: str) -> HeronError:
    return HeronError(ErrorCode.IMAGE_TOO_LARGE,
                      f"{field}: the image at {url.host} is {size}, over the limit of "
                      f"{MAX_IMAGE_BYTES} bytes", field=field)
