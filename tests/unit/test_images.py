"""Image items without a model: their wire forms, limits, decoding, preprocessing configs,
the SDK's chunking, and a coalesced neighbour's bad image failing only its own request."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from heron.gateway.coalescing import Group, Member, split_result
from heron.gateway.slicing import IMAGE_TOKENS, item_bytes, item_tokens
from heron.runtime.protocol import WorkResult
from heron.worker.images import ImageInput, ImageSpec, load_pixels, open_image, preprocess
from heron_sdk import wire
from heron_sdk.calls import as_items, chunks
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.images import MAX_IMAGES_PER_REQUEST
from heron_sdk.types import EncodeRequest, Item, ScoreRequest


def png(width: int = 4, height: int = 3, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


def refusal(fn: object, *args: object) -> HeronError:
    with pytest.raises(HeronError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize("fmt", [wire.JSON, wire.MSGPACK])
def test_image_items_and_an_image_query_survive_both_wire_forms(fmt: str) -> None:
    enc = EncodeRequest([Item("a"), Item.of_image(png(), "x")])
    assert EncodeRequest.from_wire(wire.decode(wire.encode(enc.to_wire(), fmt), fmt)).items \
        == enc.items
    score = ScoreRequest("", [Item("cat")], query_image=png())
    back = ScoreRequest.from_wire(wire.decode(wire.encode(score.to_wire(), fmt), fmt))
    assert back.query_image == png() and back.query == ""


def test_extract_takes_no_images() -> None:
    from heron_sdk.types import ExtractRequest
    error = refusal(ExtractRequest.from_wire, {"items": [{"image": "eHl6"}]})
    assert error.field == "items[0].image"


def test_images_per_request_are_bounded() -> None:
    items = [{"image": "eHl6"}] * (MAX_IMAGES_PER_REQUEST + 1)
    error = refusal(EncodeRequest.from_wire, {"items": items})
    assert (error.code, error.status) == (ErrorCode.TOO_MANY_IMAGES, 413)
    EncodeRequest.from_wire({"items": [*items[:-1], "a text"]})


def test_the_gateway_sizes_image_items_by_their_bytes() -> None:
    item = Item.of_image(b"x" * 1000, "id")
    assert item_bytes(item) >= 1000 and item_tokens(item) == IMAGE_TOKENS


def test_a_bad_image_fails_only_the_coalesced_request_that_sent_it() -> None:
    first = Member("inbox-a", "a", ["t1", "t2"], 2, 10, 0.0, 0.0)
    second = Member("inbox-b", "b", ["t3", {"image": b"?"}], 2, 10, 0.0, 0.0)
    group = Group("key", "pool", {}, 0.0, 0.0, left=True)
    group.add(first)
    group.add(second)
    error = HeronError(ErrorCode.IMAGE_INVALID, "items[3].image: not an image",
                       field="items[3].image").to_body()["error"]
    split = split_result(group, WorkResult("r", 0, 4, None, error, {}), lambda _: True)
    [(member, result)] = split.results
    assert member is second and result.error["field"] == "items[1].image"
    assert split.resend == [first]


def test_formats_outside_the_allowlist_are_refused() -> None:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="TIFF")
    error = refusal(open_image, ImageInput(out.getvalue(), "items[0].image"))
    assert error.code == ErrorCode.IMAGE_INVALID and "supported format" in error.message


@pytest.mark.parametrize("fmt", ["GIF", "BMP"])
def test_gif_and_bmp_decode(fmt: str) -> None:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 20, 30)).save(out, format=fmt)
    assert open_image(ImageInput(out.getvalue(), "x")).size == (8, 6)


def test_the_pixel_bound_is_checked_before_decoding() -> None:
    error = refusal(open_image, ImageInput(png(100, 100), "items[0].image"), 9_999)
    assert error.code == ErrorCode.IMAGE_TOO_LARGE and "100 x 100" in error.message


def test_exif_orientation_is_applied() -> None:
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed as 6 x 10
    Image.new("RGB", (10, 6)).save(out, format="JPEG", exif=exif)
    assert open_image(ImageInput(out.getvalue(), "x")).size == (6, 10)


def test_specs_from_preprocessor_configs(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 20}, "crop_size": {"height": 16, "width": 16},
        "do_center_crop": True, "resample": 2, "image_mean": [0.5] * 3,
        "image_std": [0.25] * 3}))
    spec = ImageSpec.read(tmp_path, image_size=16, siglip=False)
    assert (spec.shortest_edge, spec.crop, spec.resample, spec.std) == (20, (16, 16), 2,
                                                                         (0.25,) * 3)
    pixels = preprocess(Image.new("RGB", (40, 30), (255, 255, 255)), spec)
    assert pixels.shape == (3, 16, 16) and np.allclose(pixels, 2.0)  # (1 - 0.5) / 0.25
    siglip = ImageSpec.read(tmp_path / "none", image_size=24, siglip=True)
    assert (siglip.height, siglip.width, siglip.crop, siglip.mean) == (24, 24, None,
                                                                       (0.5,) * 3)
    assert load_pixels(ImageInput(png(50, 10, "RGBA"), "x"), siglip).shape == (24, 24, 3)


def test_the_sdk_takes_bytes_and_pil_images_and_splits_at_the_image_bound() -> None:
    items = as_items(["a", png(), Image.new("L", (3, 3))])
    assert items[0].image is None and items[1].image == png()
    assert Image.open(io.BytesIO(items[2].image or b"")).size == (3, 3)
    many = as_items([png()] * (MAX_IMAGES_PER_REQUEST + 5))
    assert [len(part) for _, part in chunks(many)] == [MAX_IMAGES_PER_REQUEST, 5]
    with pytest.raises(TypeError, match="image"):
        as_items([3.5])
    assert base64.b64decode(wire.encode({"i": b"ab"}, wire.JSON)[6:-2]) == b"ab"


def test_streamed_encodes_close_a_chunk_at_the_image_bound() -> None:
    from heron_sdk.streaming import ChunkBuilder

    builder = ChunkBuilder(1000, 1 << 30)
    closed = [chunk for _ in range(MAX_IMAGES_PER_REQUEST + 1) for chunk in builder.add(png())]
    assert [len(c.items) for c in closed] == [MAX_IMAGES_PER_REQUEST]
    rest = builder.flush()
    assert rest is not None and len(rest.items) == 1 and rest.items[0].image == png()
