"""Bad input gets a clear 4xx with a machine-readable code, and disturbs nobody else."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import numpy as np
import pytest

from heron_sdk import wire
from heron_sdk.types import MAX_BODY_BYTES, MAX_ITEMS_PER_REQUEST

ENC = "/v1/encode/minilm"
LONG = " ".join(["token"] * 600)


def error_of(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    # A msgpack request gets a msgpack answer unless Accept says otherwise.
    body = wire.decode(r.content, wire.media_type(r.headers["content-type"]) or wire.JSON)
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(("content", "ctype"), [
    (b"{not json", "application/json"),
    (b"\xc1\xc1\xc1", "application/msgpack"),
    (b"", "application/json"),
    (b"[1, 2]", "application/json"),
    (b'"just a string"', "application/json"),
])
def test_malformed_body_is_400(http: httpx.Client, content: bytes, ctype: str) -> None:
    r = http.post(ENC, content=content, headers={"content-type": ctype})
    error_of(r, 400, "MALFORMED_BODY")


def test_malformed_msgpack_answers_in_msgpack_when_accepted(http: httpx.Client) -> None:
    r = http.post(ENC, content=b"\xc1", headers={"content-type": "application/msgpack",
                                                 "accept": "application/msgpack"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(r.content)["error"]["code"] == "MALFORMED_BODY"


def test_unsupported_media_type_is_415(http: httpx.Client) -> None:
    r = http.post(ENC, content=b"a,b", headers={"content-type": "text/csv"})
    error_of(r, 415, "UNSUPPORTED_MEDIA_TYPE")


@pytest.mark.parametrize(("body", "field"), [
    ({}, "items"),
    ({"items": []}, "items"),
    ({"items": "not a list"}, "items"),
    ({"items": ["ok", 5]}, "items[1]"),
    ({"items": [{"id": "a"}]}, "items[0].text"),
    ({"items": [{"text": "a", "id": [1]}]}, "items[0].id"),
    ({"items": ["a"], "dims": "ten"}, "dims"),
    ({"items": ["a"], "dims": 0}, "dims"),
    ({"items": ["a"], "dims": 1000}, "dims"),
    ({"items": ["a"], "priority": -1}, "priority"),
    ({"items": ["a"], "timeout_s": 0}, "timeout_s"),
    ({"items": ["a"], "truncate": "no"}, "truncate"),
    ({"items": ["a"], "is_query": 1}, "is_query"),
    ({"items": ["a"], "output_types": []}, "output_types"),
    ({"items": ["a"], "encoding": "hex"}, "encoding"),
    ({"items": ["a"], "top_n": 3}, "top_n"),  # unknown fields are refused, not dropped
    ({"items": [{"text": "a", "score": 1}]}, "items[0].score"),
])
def test_invalid_field_is_422_naming_the_field(http: httpx.Client, body: dict,
                                               field: str) -> None:
    err = error_of(http.post(ENC, json=body), 422, "INVALID_FIELD")
    assert err["field"] == field and field in err["message"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/score/minilm", {"items": ["a"]}, "query"),
    ("/v1/score/minilm", {"query": "q", "items": []}, "items"),
    ("/v1/score/minilm", {"query": "q", "items": ["a"], "top_k": 0}, "top_k"),
    ("/v1/extract/tiny-ner", {"items": ["a"], "labels": "PER"}, "labels"),
    ("/v1/extract/tiny-ner", {"items": ["a"], "threshold": 2}, "threshold"),
])
def test_invalid_fields_on_score_and_extract(http: httpx.Client, path: str, body: dict,
                                             field: str) -> None:
    assert error_of(http.post(path, json=body), 422, "INVALID_FIELD")["field"] == field


def test_unknown_model_is_404(http: httpx.Client) -> None:
    for path in ("/v1/encode/no/such-model", "/v1/score/nope", "/v1/extract/nope",
                 "/v1/models/nope"):
        # each route's own fields: an unknown one is a 422 before the model is looked up
        body = {"items": ["a"], "query": "q"} if "score" in path else {"items": ["a"]}
        r = http.get(path) if "models" in path else http.post(path, json=body)
        error_of(r, 404, "MODEL_NOT_FOUND")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    error_of(http.get("/v1/nothing-here"), 404, "NOT_FOUND")
    error_of(http.get(ENC), 405, "METHOD_NOT_ALLOWED")


@pytest.mark.parametrize(("path", "body"), [
    (ENC, {"items": ["a"], "output_types": ["sparse"]}),
    (ENC, {"items": ["a"], "output_types": ["colour"]}),
    (ENC, {"items": ["a"], "output_dtype": "float64"}),
    ("/v1/encode/splade-tiny", {"items": ["a"], "output_types": ["sparse"],
                                "output_dtype": "binary"}),
])
def test_unsupported_output_is_422(http: httpx.Client, path: str, body: dict) -> None:
    error_of(http.post(path, json=body), 422, "UNSUPPORTED_OUTPUT")


def test_wrong_task_for_the_model_is_422(http: httpx.Client) -> None:
    error_of(http.post("/v1/extract/minilm", json={"items": ["a"]}), 422, "UNSUPPORTED_TASK")
    error_of(http.post("/v1/encode/tiny-cross-encoder", json={"items": ["a"]}), 422,
             "UNSUPPORTED_TASK")


def test_too_long_text_is_truncated_and_flagged_or_422(http: httpx.Client) -> None:
    r = http.post(ENC, json={"items": ["short", LONG]})
    assert r.status_code == 200
    assert [i["truncated"] for i in r.json()["items"]] == [False, True]
    err = error_of(http.post(ENC, json={"items": ["short", LONG], "truncate": False}), 422,
                   "INPUT_TOO_LONG")
    assert err["field"] == "items[1]"
    err = error_of(http.post("/v1/score/minilm", json={"query": "q", "items": [LONG],
                                                       "truncate": False}),
                   422, "INPUT_TOO_LONG")


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = b'{"items": ["' + b"a" * (MAX_BODY_BYTES + 10) + b'"]}'
    error_of(http.post(ENC, content=big, headers={"content-type": "application/json"}), 413,
             "PAYLOAD_TOO_LARGE")

    def chunks():  # no Content-Length: the limit holds for streamed bodies too
        yield b'{"items": ["'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'"]}'

    error_of(http.post(ENC, content=chunks(), headers={"content-type": "application/json"}),
             413, "PAYLOAD_TOO_LARGE")


def test_a_body_streamed_in_pieces_is_read_whole(http: httpx.Client) -> None:
    """No Content-Length, the body in several chunks: the same answer as sent in one."""
    body = b'{"items": ["a heron in the reeds", "a second text"]}'

    def pieces():
        for start in range(0, len(body), 7):
            yield body[start:start + 7]

    whole = http.post(ENC, content=body, headers={"content-type": "application/json"})
    streamed = http.post(ENC, content=pieces(), headers={"content-type": "application/json"})
    assert whole.status_code == streamed.status_code == 200, streamed.text
    # (the second answer may come from the result cache, which it says: compare vectors)
    assert [i["dense"] for i in streamed.json()["items"]] == \
        [i["dense"] for i in whole.json()["items"]]
    assert len(streamed.json()["items"]) == 2


def test_item_count_limit(http: httpx.Client) -> None:
    error_of(http.post(ENC, json={"items": ["a"] * (MAX_ITEMS_PER_REQUEST + 1)}), 413,
             "TOO_MANY_ITEMS")


def test_a_full_size_request_is_batched_internally(http: httpx.Client) -> None:
    # A tiny model: the batching is the same, and MiniLM took 25 s of CI for it.
    tiny = "/v1/encode/tiny-dense-cls"
    texts = [f"item number {i} of a large request" for i in range(MAX_ITEMS_PER_REQUEST)]
    r = http.post(tiny, json={"items": texts}, timeout=300)
    assert r.status_code == 200, r.text
    vecs = np.array([i["dense"] for i in r.json()["items"]])
    assert vecs.shape == (MAX_ITEMS_PER_REQUEST, 32)
    assert len({v.tobytes() for v in vecs}) == MAX_ITEMS_PER_REQUEST  # no row repeated
    solo = http.post(tiny, json={"items": [texts[1234]]}).json()["items"][0]["dense"]
    np.testing.assert_allclose(vecs[1234], solo, atol=2e-5)


def test_deadline_exceeded_is_504(http: httpx.Client) -> None:
    texts = [f"slow request {i} " * 20 for i in range(2000)]
    r = http.post(ENC, json={"items": texts, "timeout_s": 0.05})
    error_of(r, 504, "DEADLINE_EXCEEDED")
    assert http.post(ENC, json={"items": ["still alive"]}).status_code == 200


def test_bad_requests_do_not_disturb_good_ones(base_url: str, http: httpx.Client) -> None:
    good_texts = [f"good request number {i}" for i in range(30)]
    expected = [http.post(ENC, json={"items": [t]}).json()["items"][0]["dense"]
                for t in good_texts]
    bad_bodies = [b"{oops", b'{"items": []}', b'{"items": ["x"], "dims": -1}',
                  b'{"items": ["x"], "output_types": ["sparse"]}',
                  b'{"items": ["' + LONG.encode() + b'"], "truncate": false}']

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            good = [client.post(ENC, json={"items": [t]}) for t in good_texts]
            bad = [client.post(ENC, content=b, headers={"content-type": "application/json"})
                   for b in bad_bodies * 4]
            return await asyncio.gather(*good, *bad)

    responses = asyncio.run(run())
    good, bad = responses[:30], responses[30:]
    for r, want in zip(good, expected, strict=True):
        assert r.status_code == 200
        np.testing.assert_allclose(r.json()["items"][0]["dense"], want, atol=2e-5)
    odd = [(r.status_code, r.text) for r in bad if not 400 <= r.status_code < 500]
    assert not odd
    assert http.get("/healthz").status_code == 200
