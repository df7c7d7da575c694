"""Image URLs before any fetch: the operator's allowlist (exact hosts, ``*.`` suffixes, IP
literals) and its setting, what the parser keeps of a URL and what the schema allows, and
the fetcher's checks, which refuse without a connection. tests/integration/test_image_urls.py
fetches over loopback."""

from __future__ import annotations

import asyncio

import jsonschema_rs
import pytest

from heron.gateway.settings import GatewaySettings
from heron.runtime.backend import InferenceCall
from heron.runtime.image_urls import HostAllowlist, ImageFetcher
from heron.runtime.modelconfig import ConfigError
from heron.worker.settings import WorkerSettings
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.images import IMAGE_PATTERN, MAX_IMAGE_URL_CHARS
from heron_sdk.types import EncodeRequest, Item, ScoreRequest

URL = "http://127.0.0.1:9/a.png"


@pytest.mark.parametrize(("entries", "host", "allowed"), [
    ("images.example.com", "images.example.com", True),
    ("images.example.com", "IMAGES.Example.COM", True),
    ("images.example.com", "images.example.com.", True),  # the same name, fully qualified
    ("images.example.com.", "images.example.com", True),
    ("images.example.com", "example.com", False),
    ("images.example.com", "evil-images.example.com", False),
    ("images.example.com", "images.example.com.evil.net", False),
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "a.b.example.com", True),
    ("*.example.com", "example.com", False),  # the wildcard is for names under it
    ("*.example.com", "badexample.com", False),
    ("*.example.com", "a.example.com.evil.net", False),
    ("127.0.0.1", "127.0.0.1", True),
    ("127.0.0.1", "localhost", False),  # names and addresses are not resolved to compare
    ("localhost", "127.0.0.1", False),
    ("127.0.0.1", "127.1", False),
    ("127.0.0.1", "2130706433", False),
    ("[::1]", "::1", True),
    ("::1", "0:0:0:0:0:0:0:1", True),  # one address, two spellings
    ("*.0.1", "10.0.0.1", False),  # a wildcard never matches an IP address
    ("a.com, ,b.com", "b.com", True),
    ("", "anything", False),
    ("a.com", "", False),
])
def test_allowlist_matching(entries: str, host: str, allowed: bool) -> None:
    assert HostAllowlist.parse(entries).allows(host) is allowed


@pytest.mark.parametrize("entry", ["*", "*.", "http://a.com", "a.com:8080", "a.com/x",
                                   "user@a.com", "a b", "a..b", "*.1.2.3.4", "*a.com",
                                   "a.*.com", "ex%41mple.com"])
def test_a_bad_entry_is_a_config_error_naming_the_setting(entry: str) -> None:
    with pytest.raises(ValueError):
        HostAllowlist.parse(entry)
    for cls in (GatewaySettings, WorkerSettings):
        with pytest.raises(ConfigError, match="HERON_IMAGE_URL_HOSTS"):
            cls.from_env({"HERON_IMAGE_URL_HOSTS": f"ok.example.com,{entry}"})


def test_the_setting_is_off_by_default_and_the_same_variable_everywhere() -> None:
    for cls in (GatewaySettings, WorkerSettings):
        assert cls().image_url_hosts is None and not HostAllowlist.parse(None)
        got = cls.from_env({"HERON_IMAGE_URL_HOSTS": "127.0.0.1",
                            "HERON_IMAGE_URL_TIMEOUT_S": "2.5"})
        assert (got.image_url_hosts, got.image_url_timeout_s) == ("127.0.0.1", 2.5)
    with pytest.raises(ConfigError, match="HERON_IMAGE_URL_TIMEOUT_S"):
        GatewaySettings.from_env({"HERON_IMAGE_URL_TIMEOUT_S": "0"})


# ---- the parser keeps a URL; the schema allows what the parser takes ------------------------
VALID = jsonschema_rs.Draft202012Validator({"type": "string", "pattern": IMAGE_PATTERN}).is_valid


@pytest.mark.parametrize(("value", "kept"), [
    ("https://images.example.com/cat.png?size=2", True),
    ("HTTP://x/y", True),
    ("http://" + "a" * MAX_IMAGE_URL_CHARS, True),
    ("http://" + "a" * (MAX_IMAGE_URL_CHARS + 1), False),
    ("http://", False),
    ("http://a b/c.png", False),
    ("http://exämple.com/c.png", False),  # an IDN host goes in its xn-- form
    ("http://a/\n", False),
    ("ftp://a/b.png", False),
    ("file:///etc/passwd", False),
])
def test_the_parser_keeps_exactly_the_urls_the_schema_allows(value: str, kept: bool) -> None:
    assert VALID(value) is kept
    body = {"items": [{"image": value, "id": "u"}]}
    if kept:
        item = EncodeRequest.from_wire(body).items[0]
        assert (item.image, item.image_url, item.id, item.text) == (None, value, "u", "")
        assert item.is_image
    else:
        with pytest.raises(HeronError) as refused:
            EncodeRequest.from_wire(body)
        assert refused.value.field == "items[0].image" and refused.value.status == 422


def test_urls_round_trip_through_the_wire_form_and_count_as_images() -> None:
    req = ScoreRequest.from_wire({"query": {"image": URL}, "items": [{"image": URL}, "t"]})
    assert (req.query, req.query_image, req.query_image_url) == ("", None, URL)
    wire = req.to_wire()
    assert wire["query"] == {"image": URL} and wire["items"][0] == {"image": URL}
    assert ScoreRequest.from_wire(wire).items == req.items
    assert Item.of_image_url(URL, "k").to_wire() == {"image": URL, "id": "k"}
    many = {"items": [{"image": URL}] * 65}
    with pytest.raises(HeronError) as refused:
        EncodeRequest.from_wire(many)
    assert refused.value.code == ErrorCode.TOO_MANY_IMAGES


# ---- the fetcher refuses before it connects ---------------------------------------------------
def fetch(fetcher: ImageFetcher, body: dict) -> HeronError:
    req = EncodeRequest.from_wire(body)
    assert ImageFetcher.pending(req)
    with pytest.raises(HeronError) as refused:
        asyncio.run(fetcher.fetch(req, InferenceCall({})))
    assert fetcher._client is None  # refused before any connection was set up
    return refused.value


def test_no_hosts_refuses_every_url_and_names_the_setting() -> None:
    error = fetch(ImageFetcher(), {"items": ["text", {"image": URL}]})
    assert (error.code, error.field) == (ErrorCode.IMAGE_URL_REFUSED, "items[1].image")
    assert "--image-url-hosts" in error.message and "HERON_IMAGE_URL_HOSTS" in error.message


@pytest.mark.parametrize(("url", "why"), [
    ("http://localhost:9/a.png", "'localhost'"),
    ("http://127.0.0.1@evil.example/a.png", "credentials"),
    ("http://evil.example#@127.0.0.1/a.png", "'evil.example'"),
    ("http://127.0.0.1.evil.example/a.png", "'127.0.0.1.evil.example'"),
])
def test_a_host_not_on_the_list_is_refused_by_name(url: str, why: str) -> None:
    fetcher = ImageFetcher("127.0.0.1")
    error = fetch(fetcher, {"items": [{"image": url}]})
    assert (error.code, error.field) == (ErrorCode.IMAGE_URL_REFUSED, "items[0].image")
    assert why in error.message


def test_every_url_is_checked_before_any_is_fetched() -> None:
    """The allowed first URL is not fetched: the refused second one fails the request
    first (nothing listens on port 9 either way)."""
    error = fetch(ImageFetcher("127.0.0.1"),
                  {"items": [{"image": URL}, {"image": "http://10.0.0.1/x.png"}]})
    assert (error.code, error.field) == (ErrorCode.IMAGE_URL_REFUSED, "items[1].image")


def test_a_request_without_urls_is_not_touched() -> None:
    req = EncodeRequest.from_wire({"items": ["a", {"image": "iVBORw0KGgo="}]})
    assert not ImageFetcher.pending(req)
    assert asyncio.run(ImageFetcher("127.0.0.1").fetch(req, InferenceCall({}))) == 0.0
