"""Wire codec, content negotiation and output dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from heron.worker.outputs import quantize, truncate_dims
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import EncodeRequest


def test_msgpack_carries_numpy_arrays() -> None:
    body = {"dense": np.arange(5, dtype=np.float32), "n": 3, "s": "x"}
    back = wire.decode(wire.encode(body, wire.MSGPACK), wire.MSGPACK)
    assert back["dense"].dtype == np.float32
    np.testing.assert_array_equal(back["dense"], body["dense"])


def test_json_turns_arrays_into_lists() -> None:
    out = wire.decode(wire.encode({"v": np.array([1.5, 2.0], dtype=np.float32)}, wire.JSON),
                      wire.JSON)
    assert out == {"v": [1.5, 2.0]}


@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(-10, 10, width=32)))
def test_base64_round_trip(vec: np.ndarray) -> None:
    np.testing.assert_array_equal(wire.base64_to_array(wire.array_to_base64(vec), "float32"),
                                  vec)


@pytest.mark.parametrize(("content_type", "fmt"), [
    (None, wire.JSON), ("application/json; charset=utf-8", wire.JSON),
    ("application/msgpack", wire.MSGPACK), ("application/x-msgpack", wire.MSGPACK),
    ("application/x-www-form-urlencoded", wire.JSON),
])
def test_request_format(content_type: str | None, fmt: str) -> None:
    assert wire.request_format(content_type) == fmt


def test_unknown_content_type_is_415() -> None:
    with pytest.raises(HeronError) as err:
        wire.request_format("text/csv")
    assert err.value.status == 415


def test_accept_overrides_request_format() -> None:
    assert wire.response_format("application/msgpack", wire.JSON) == wire.MSGPACK
    assert wire.response_format("application/json", wire.MSGPACK) == wire.JSON
    assert wire.response_format(None, wire.MSGPACK) == wire.MSGPACK
    assert wire.response_format("*/*", wire.JSON) == wire.JSON


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe"])
def test_malformed_bodies_are_400(body: bytes) -> None:
    with pytest.raises(HeronError) as err:
        wire.decode(body, wire.JSON)
    assert err.value.code is ErrorCode.MALFORMED_BODY and err.value.status == 400


def test_encode_request_round_trips_through_the_wire() -> None:
    req = EncodeRequest.from_wire({"items": ["a", {"text": "b", "id": 7}], "dims": 8,
                                   "output_dtype": "int8", "priority": 2, "timeout_s": 1.5})
    again = EncodeRequest.from_wire(req.to_wire())
    assert again == req
    assert again.items[1].id == "7"


@given(arrays(np.float32, (3, 16), elements=st.floats(-1, 1, width=32)))
def test_int8_and_uint8_keep_direction(vectors: np.ndarray) -> None:
    for dtype in ("int8", "uint8"):
        q = quantize(vectors, dtype).astype(np.float32)
        if dtype == "uint8":
            q -= 128
        for v, w in zip(vectors, q, strict=True):
            if np.abs(v).max() > 1e-3:
                cos = v @ w / (np.linalg.norm(v) * np.linalg.norm(w))
                assert cos > 0.99


def test_binary_packs_sign_bits() -> None:
    v = np.array([[0.5, -1, 2, 0, -3, 1, 1, -1, 4]], dtype=np.float32)
    packed = quantize(v, "binary")
    assert packed.dtype == np.uint8 and packed.shape == (1, 2)
    np.testing.assert_array_equal(np.unpackbits(packed, axis=-1)[:, :9], (v > 0).astype(np.uint8))


def test_float16() -> None:
    assert quantize(np.ones((2, 4), np.float32), "float16").dtype == np.float16


def test_matryoshka_truncates_and_renormalizes() -> None:
    v = np.random.default_rng(0).normal(size=(2, 32)).astype(np.float32)
    cut = truncate_dims(v, 8, renormalize=True)
    assert cut.shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(cut[0] / cut[0, 0], v[0, :8] / v[0, 0], rtol=1e-4)
    with pytest.raises(HeronError):
        truncate_dims(v, 64, renormalize=True)
