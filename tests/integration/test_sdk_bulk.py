"""Bulk encoding with the SDK against real servers: ``encode_stream`` and ``encode`` of a
generator, sync and async.

The acceptance run: 200,000 short texts from a generator against `heron serve --bundle
null` (real tokenizer, no compute), in a child process that only runs the SDK, with its
peak RSS under 300 MB and every item back at its input position. The rest checks results
against plain ``encode`` on MiniLM (the session's test bundle), errors mid-stream (a
request refused by the server, an input that raises) and the progress bar.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
from tqdm import tqdm

from heron_sdk import AsyncClient, Client, Item, RequestError
from tests.support.servers import REPO, ServerProcess, start_serve

BULK_ITEMS = 200_000
PEAK_RSS_LIMIT_MB = 300
NULL_MODEL = "heron/null"


@pytest.fixture(scope="module")
def null_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_serve(REPO / "bundles" / "null.yaml", tmp_path_factory.mktemp("null-logs"))
    yield server
    server.stop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_200k_texts_from_a_generator_in_bounded_memory(null_server: ServerProcess,
                                                       mode: str) -> None:
    # Through a shell that forks: Linux carries ru_maxrss across exec, and a child forked
    # (or vforked) straight from pytest would start with pytest's own peak (torch and all).
    child = [sys.executable, str(REPO / "tests" / "support" / "bulk_client.py"),
             null_server.url, NULL_MODEL, str(BULK_ITEMS), mode]
    proc = subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh", *child],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nbulk {mode}: {report}")  # pytest -s shows the numbers (docs/benchmarks.md)
    assert report["items"] == BULK_ITEMS and report["mismatches"] == 0
    assert report["dim"] == 384 and report["chunks"] == -(-BULK_ITEMS // 2048)
    assert report["peak_rss_mb"] < PEAK_RSS_LIMIT_MB, report


# ---- the same answers as encode, in order ----------------------------------------------------
TEXTS = [f"the heron waits in the shallows, {n} times" * (1 + n % 3) for n in range(23)]


def generated() -> Iterator[Item | str]:
    for n, text in enumerate(TEXTS):
        yield Item(text, id=f"doc-{n}") if n % 2 else text


def test_stream_and_encode_of_a_generator_match_encode_of_a_list(base_url: str) -> None:
    with Client(base_url) as client:
        want = client.encode("minilm", list(generated()))
        chunks = list(client.encode_stream("minilm", generated(), chunk_size=5,
                                           max_in_flight=3))
        got = client.encode("minilm", generated())
    assert [c.offset for c in chunks] == [0, 5, 10, 15, 20]
    assert [len(c) for c in chunks] == [5, 5, 5, 5, 3]
    np.testing.assert_allclose(np.concatenate([c.dense for c in chunks]), want.dense,
                               atol=1e-5)
    assert [e.id for c in chunks for e in c] == [e.id for e in want]
    assert [i.text for c in chunks for i in c.inputs] == TEXTS
    np.testing.assert_allclose(got.dense, want.dense, atol=1e-5)
    assert [(e.id, e.tokens) for e in got] == [(e.id, e.tokens) for e in want]
    assert got.tokens == want.tokens and len(got.raw["items"]) == len(TEXTS)


async def test_async_stream_of_an_async_iterable(base_url: str) -> None:
    async def texts() -> AsyncIterator[Item | str]:
        for item in generated():
            await asyncio.sleep(0)
            yield item

    async with AsyncClient(base_url, wire="json") as client:
        want = await client.encode("minilm", list(generated()))
        chunks = [c async for c in client.encode_stream("minilm", texts(), chunk_size=4)]
        got = await client.encode("minilm", texts())
    assert [c.offset for c in chunks] == list(range(0, 23, 4))
    np.testing.assert_allclose(np.concatenate([c.dense for c in chunks]), want.dense,
                               atol=1e-5)
    np.testing.assert_allclose(got.dense, want.dense, atol=1e-5)


# ---- errors mid-stream -----------------------------------------------------------------------
def with_a_text_too_long(count: int, at: int) -> Iterator[str]:
    for n in range(count):
        yield "x" * 1_000_001 if n == at else f"text {n}"  # the server answers 413


def test_a_refused_request_raises_at_its_position(null_server: ServerProcess) -> None:
    handed = []
    with Client(null_server.url) as client, pytest.raises(RequestError) as info:
        for chunk in client.encode_stream(NULL_MODEL, with_a_text_too_long(1000, 450),
                                          chunk_size=100, max_in_flight=4):
            handed.extend(chunk.positions)
    assert handed == list(range(400))  # every chunk before the failing one, none after
    assert info.value.status == 413
    assert any("items 400..499 of the stream" in note for note in info.value.__notes__)


async def test_async_refused_request_and_a_failing_input(null_server: ServerProcess) -> None:
    async with AsyncClient(null_server.url) as client:
        handed: list[int] = []
        with pytest.raises(RequestError):
            async for chunk in client.encode_stream(NULL_MODEL, with_a_text_too_long(1000, 450),
                                                    chunk_size=100):
                handed.extend(chunk.positions)
        assert handed == list(range(400))

        def broken() -> Iterator[str]:
            yield from (f"text {n}" for n in range(250))
            raise OSError("the file went away")

        handed.clear()
        with pytest.raises(OSError, match="went away") as info:
            async for chunk in client.encode_stream(NULL_MODEL, broken(), chunk_size=100):
                handed.extend(chunk.positions)
        assert handed == list(range(250))  # the last 50 were sent before the error rose
        assert any("failed at item 250" in note for note in info.value.__notes__)

        # Stopping early cancels what is in flight; the client goes on working.
        stream = client.encode_stream(NULL_MODEL, (f"t{n}" for n in range(10_000)),
                                      chunk_size=50)
        async with contextlib.aclosing(stream):
            first = await anext(stream)
        assert first.offset == 0
        assert len(await client.encode(NULL_MODEL, ["still here"])) == 1


def test_sync_failing_input_and_early_stop(null_server: ServerProcess) -> None:
    def broken() -> Iterator[str]:
        yield from (f"text {n}" for n in range(250))
        raise OSError("the file went away")

    with Client(null_server.url) as client:
        handed = []
        with pytest.raises(OSError, match="went away"):
            for chunk in client.encode_stream(NULL_MODEL, broken(), chunk_size=100):
                handed.extend(chunk.positions)
        assert handed == list(range(250))
        stream = client.encode_stream(NULL_MODEL, (f"t{n}" for n in range(10_000)),
                                      chunk_size=50)
        first = next(stream)
        stream.close()  # stops early: nothing more is read or sent
        assert first.offset == 0 and len(client.encode(NULL_MODEL, ["still here"])) == 1


# ---- progress --------------------------------------------------------------------------------
def test_the_progress_bar_reaches_the_total(null_server: ServerProcess,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with Client(null_server.url) as client:
        got = client.encode(NULL_MODEL, (f"text {n}" for n in range(500)), progress=True)
        assert len(got) == 500
        assert "500item " in capsys.readouterr().err  # a generator has no length: a count
        chunks = list(client.encode_stream(NULL_MODEL, (f"t{n}" for n in range(500)),
                                           chunk_size=64, progress=True, total=500))
        assert sum(len(c) for c in chunks) == 500
        err = capsys.readouterr().err
        assert "100%" in err and "500/500" in err
        out = io.StringIO()
        bar = tqdm(total=500, file=out)
        for _ in client.encode_stream(NULL_MODEL, [f"t{n}" for n in range(500)],
                                      chunk_size=64, progress=bar):
            pass
        assert bar.n == 500  # a bar of the caller's own is updated, not closed
        bar.close()
        assert "500/500" in out.getvalue()
