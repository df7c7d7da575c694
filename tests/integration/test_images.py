"""Image items end to end: `heron serve` on loopback with tiny CLIP and SigLIP checkpoints
(JSON, msgpack, the SDK with PIL images), a bad image refused in its item's place with a
code while its neighbours are answered, and requests through the cluster path (gateway ->
NATS -> worker), alone and sharing work items.

Vectors are compared with transformers' own (tests/parity/test_clip.py holds the wider
comparison over formats, sizes and modes).
"""

from __future__ import annotations

import base64
import io
import json
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from heron_sdk import Client, RequestError, wire
from heron_sdk.errors import STATUS_BY_CODE
from heron_sdk.images import MAX_IMAGE_BYTES, MAX_IMAGES_PER_REQUEST
from tests.integration.test_cli_client import heron
from tests.parity.test_clip import cosines, reference
from tests.support.gateway_harness import GatewayThread, start_worker, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import ServerProcess, start_serve
from tests.support.tiny_vision import build_tiny_clip, build_tiny_siglip, image_bytes

CLIP = "/v1/encode/tiny-clip"
TEXTS = ["a photo of a cat", "a dog on the grass"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path]:
    """The checkpoints and a bundle serving them: CLIP named as adapter clip, SigLIP left to
    detection (adapter auto)."""
    root = tmp_path_factory.mktemp("vision")
    models = {"tiny-clip": build_tiny_clip(root / "clip"),
              "tiny-siglip": build_tiny_siglip(root / "siglip")}
    (root / "models").mkdir()
    for name, adapter in (("tiny-clip", "clip"), ("tiny-siglip", "auto")):
        config = {"id": f"test/{name}", "aliases": [name], "adapter": adapter,
                  "source": {"path": str(models[name])}, "profiles": {"default": {}}}
        (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(config))
    bundle = root / "vision.yaml"
    bundle.write_text(yaml.safe_dump({"name": "vision",
                                      "models": ["tiny-clip.yaml", "tiny-siglip.yaml"]}))
    return models, bundle


@pytest.fixture(scope="module")
def serve(vision: tuple[dict[str, Path], Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_serve(vision[1], tmp_path_factory.mktemp("vision-logs"))
    yield proc
    proc.stop()


@pytest.fixture()
def http(serve: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve.url, timeout=60) as client:
        yield client


def dense(body: dict) -> np.ndarray:
    return np.array([row["dense"] for row in body["items"]], dtype=np.float32)


@pytest.mark.parametrize("model", ["tiny-clip", "tiny-siglip"])
def test_json_images_and_texts_match_transformers(http: httpx.Client, model: str,
                                                  vision: tuple[dict[str, Path], Path]) -> None:
    files = [image_bytes(40, 30, "PNG", 1), image_bytes(64, 20, "JPEG", 2),
             image_bytes(17, 90, "WEBP", 3)]
    items = [{"image": b64(files[0]), "id": "png"},
             {"image": f"data:image/jpeg;base64,{b64(files[1])}"},
             TEXTS[0], {"image": b64(files[2])}, {"text": TEXTS[1], "id": 7}]
    r = http.post(f"/v1/encode/{model}", json={"items": items})
    assert r.status_code == 200, r.text
    body = r.json()
    got = dense(body)
    want_images, want_texts = reference(vision[0][model], files, TEXTS)
    assert cosines(got[[0, 1, 3]], want_images).min() >= 0.9999
    assert cosines(got[[2, 4]], want_texts).min() >= 0.9999
    assert body["items"][0]["id"] == "png" and body["items"][4]["id"] == "7"
    patches = 17 if model == "tiny-clip" else 16  # (32 / 8)^2, plus CLIP's class token
    assert [row["tokens"] for row in body["items"][:2]] == [patches, patches]
    info = http.get(f"/v1/models/{model}").json()
    assert "clip" in str(info)  # auto detected SigLIP's family from its config.json


def test_msgpack_and_sdk_with_pil_images_give_the_same_vectors(http: httpx.Client,
                                                               serve: ServerProcess) -> None:
    png = image_bytes(50, 50, "PNG", 4)
    r = http.post(CLIP, json={"items": [{"image": b64(png)}, TEXTS[0]]})
    want = dense(r.json())
    packed = http.post(CLIP, content=wire.encode({"items": [{"image": png}, TEXTS[0]]},
                                                 wire.MSGPACK),
                       headers={"content-type": wire.MSGPACK})
    assert packed.status_code == 200, packed.text
    np.testing.assert_allclose(dense(wire.decode(packed.content, wire.MSGPACK)), want,
                               atol=1e-6)
    with Client(serve.url) as client:
        result = client.encode("tiny-clip", [Image.open(io.BytesIO(png)), TEXTS[0], png])
        np.testing.assert_allclose(result.dense[:2], want, atol=1e-6)
        np.testing.assert_allclose(result.dense[2], want[0], atol=1e-6)
        # score: a text query ranks images; an image query ranks texts, by cosine
        others = [image_bytes(50, 50, "PNG", 5), png]
        ranked = client.score("tiny-clip", TEXTS[0], others)
        best = ranked.results[0]
        assert best.index == 1 and abs(best.score - float(want[0] @ want[1])) < 1e-5
        by_image = client.score("tiny-clip", Image.open(io.BytesIO(png)), TEXTS)
        assert {r.index for r in by_image.results} == {0, 1}
        assert abs(next(r.score for r in by_image.results if r.index == 0)
                   - float(want[0] @ want[1])) < 1e-5


def test_cli_encodes_an_image_file(serve: ServerProcess, http: httpx.Client,
                                   tmp_path: Path) -> None:
    png = image_bytes(40, 40, "PNG", 10)
    (tmp_path / "x.png").write_bytes(png)
    out = heron("encode", "tiny-clip", TEXTS[0], "--image", str(tmp_path / "x.png"),
                "--url", serve.url)
    assert out.returncode == 0, out.stderr
    want = dense(http.post(CLIP, json={"items": [TEXTS[0], {"image": b64(png)}]}).json())
    np.testing.assert_allclose(dense(json.loads(out.stdout)), want, atol=1e-6)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return (len(data).to_bytes(4, "big") + kind + data
            + zlib.crc32(kind + data).to_bytes(4, "big"))


def bomb_png(side: int = 20000) -> bytes:
    """A PNG whose header says side x side greyscale pixels (400 MB decoded), of a few KB:
    its IDAT holds only the first rows, which a decoder would find out only after
    allocating the whole image; the header check refuses it before that."""
    header = side.to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    data = zlib.compress(b"\x00" * (side + 1) * 64, 9)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", data)
            + png_chunk(b"IEND", b""))


BAD_IMAGES = {
    "truncated": (image_bytes(64, 64, "PNG", 6)[:300], 422, "IMAGE_INVALID"),
    "svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', 422,
            "IMAGE_INVALID"),
    "text": (b"this is a text, not an image", 422, "IMAGE_INVALID"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_bad_image_fails_only_its_item(http: httpx.Client, case: str) -> None:
    data, status, code = BAD_IMAGES[case]
    good = {"image": b64(image_bytes(32, 32, "PNG", 7))}
    r = http.post(CLIP, json={"items": ["fine", good, {"image": b64(data)}, {"text": "also",
                                                                            "id": 7}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["errors"] == 1
    error = body["items"][2]["error"]
    assert (error["code"], error["field"]) == (code, "items[2].image")
    assert STATUS_BY_CODE[error["code"]] == status
    alone = http.post(CLIP, json={"items": ["fine", good, {"text": "also", "id": 7}]}).json()
    rows = [body["items"][n] for n in (0, 1, 3)]
    np.testing.assert_allclose(dense({"items": rows}), dense(alone), atol=1e-6)
    assert rows[2]["id"] == "7" and body["usage"] == alone["usage"]
    # With no item left to answer, the request fails with the item's error.
    r = http.post(CLIP, json={"items": [{"image": b64(data)}]})
    assert r.status_code == status, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["field"]) == (code, "items[0].image")


def test_sdk_reports_a_bad_image_on_its_item(serve: ServerProcess) -> None:
    png = image_bytes(24, 24, "PNG", 3)
    with Client(serve.url) as client:
        result = client.encode("tiny-clip", [Image.open(io.BytesIO(png)), b"not an image",
                                             "text"])
        assert [n for n, _ in result.errors] == [1]
        error = result.items[1].error
        assert isinstance(error, RequestError)
        assert (error.code, error.status) == ("IMAGE_INVALID", 422)
        assert result.items[0].dense is not None and result.items[2].dense is not None
        with pytest.raises(RequestError, match="1 of 3 items failed"):
            _ = result.dense


def test_decompression_bomb_is_refused_from_its_header(http: httpx.Client) -> None:
    bomb = bomb_png()
    assert len(bomb) < 8_000
    for items, status in (([{"image": bomb}], 413), (["next to it", {"image": bomb}], 200)):
        r = http.post(CLIP, content=wire.encode({"items": items}, wire.MSGPACK),
                      headers={"content-type": wire.MSGPACK, "accept": wire.JSON})
        assert r.status_code == status, r.text
        error = r.json()["error"] if status == 413 else r.json()["items"][1]["error"]
        assert error["code"] == "IMAGE_TOO_LARGE"
        assert "pixels" in error["message"]


def test_score_with_a_bad_image_fails_whole(http: httpx.Client) -> None:
    """A ranking with a hole in it would be a wrong answer: score refuses the request."""
    r = http.post("/v1/score/tiny-clip", json={"query": "a cat", "items": [
        {"image": b64(image_bytes(16, 16, "PNG", 1))}, {"image": b64(b"broken")}]})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "items[1].image"


@pytest.mark.parametrize(("body", "status", "code", "field"), [
    ({"items": [{"image": "https://169.254.169.254/latest/meta-data"}]}, 422,
     "IMAGE_URL_REFUSED", "items[0].image"),
    ({"items": [{"image": "not base64!"}]}, 422, "IMAGE_INVALID", "items[0].image"),
    ({"items": [{"image": b64(b"x" * (MAX_IMAGE_BYTES + 1))}]}, 413, "IMAGE_TOO_LARGE",
     "items[0].image"),
    ({"items": [{"image": "iVBORw0KGgo="}] * (MAX_IMAGES_PER_REQUEST + 1)}, 413,
     "TOO_MANY_IMAGES", "items"),
])
def test_request_limits(http: httpx.Client, body: dict, status: int, code: str,
                        field: str) -> None:
    r = http.post(CLIP, json=body)
    assert r.status_code == status, r.text[:300]
    assert (r.json()["error"]["code"], r.json()["error"]["field"]) == (code, field)


def test_the_server_is_unharmed_after_bad_images(http: httpx.Client) -> None:
    for data, *_ in BAD_IMAGES.values():
        http.post(CLIP, json={"items": [{"image": b64(data)}]})
    r = http.post(CLIP, json={"items": [{"image": b64(image_bytes(32, 32, "PNG", 8))}, "ok"]})
    assert r.status_code == 200 and len(r.json()["items"]) == 2
    assert http.get("/readyz").status_code == 200


def test_openai_route_stays_text_only(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": "tiny-clip",
                                          "input": [{"image": b64(image_bytes(8, 8))}]})
    assert r.status_code in (400, 422), r.text


def test_one_request_through_the_cluster(vision: tuple[dict[str, Path], Path],
                                         nats_server: NatsServer, http: httpx.Client,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    pool = unique("vision")
    worker = start_worker(nats_server.url, pool, vision[1],
                          tmp_path_factory.mktemp("vision-worker"))
    gateway = GatewayThread(nats_server.url, {str(vision[1]): pool}).start()
    try:
        gateway.wait_for_capacity(pool, 60, worker.log)
        png = image_bytes(45, 30, "PNG", 9)
        body = {"items": [{"image": b64(png)}, TEXTS[0]]}
        want = dense(http.post(CLIP, json=body).json())
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            r = client.post(CLIP, json=body)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(dense(r.json()), want, atol=1e-5)
            bad = client.post(CLIP, json={"items": [TEXTS[0], {"image": b64(b"nope")}]})
            assert bad.status_code == 200, bad.text
            assert bad.json()["items"][1]["error"]["field"] == "items[1].image"
            np.testing.assert_allclose(dense({"items": bad.json()["items"][:1]}), want[1:],
                                       atol=1e-5)
            alone = client.post(CLIP, json={"items": [{"image": b64(b"nope")}]})
            assert alone.status_code == 422, alone.text
            assert alone.json()["error"]["field"] == "items[0].image"
            # Requests sent together share work items: each keeps its own items' errors.
            bodies = [{"items": [TEXTS[n % 2], {"image": b64(b"nope" if n % 3 else png)}]}
                      for n in range(12)]
            with ThreadPoolExecutor(12) as pool:
                answers = list(pool.map(lambda b: client.post(CLIP, json=b), bodies))
            for n, answer in enumerate(answers):
                assert answer.status_code == 200, answer.text
                rows = answer.json()["items"]
                assert ("error" in rows[1]) == bool(n % 3), rows
                if n % 3:
                    assert rows[1]["error"]["field"] == "items[1].image"
                    assert answer.json()["errors"] == 1
    finally:
        gateway.stop()
        worker.stop()
