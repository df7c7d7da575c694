"""A bulk job's input read shard by shard from a real S3 API (moto's server on loopback):
the tests of tests/unit/test_job_input.py, their input put in a bucket, so the first
pass's streaming GET, the shards' ranged GETs, Parquet through ranged GETs and the ETag
check (``IfMatch``) meet S3's own answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from heron.runtime.job_files import Location, S3Location
from tests.support.config_procs import MotoS3
from tests.unit.test_job_input import (  # noqa: F401  (collected here, with this put)
    Put,
    test_an_input_changed_mid_job_fails_it,
    test_csv_shards_keep_quoted_newlines_and_skip_the_bom,
    test_jsonl_shards_have_their_rows_blank_lines_none_bad_ones_failed,
    test_large_inputs_keep_one_offset_a_shard,
    test_parquet_shards_across_row_groups,
    tiny_blocks,
)

BUCKET = "jobs-input"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    server = MotoS3(tmp_path_factory.mktemp("moto"))
    try:
        yield server.weights_env(BUCKET)
    finally:
        server.stop()


@pytest.fixture
def put(moto: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Put:
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_DEFAULT_REGION", "AWS_MAX_ATTEMPTS"):
        monkeypatch.setenv(key, moto[key])
    from heron.runtime.job_files import s3_client

    client = s3_client()

    def put_s3(data: bytes, name: str) -> Location:
        client.put_object(Bucket=BUCKET, Key=f"in/{name}", Body=data)
        return S3Location(BUCKET, f"in/{name}")
    return put_s3


def test_a_missing_object_is_422_naming_the_uri(put: Put) -> None:
    from heron.runtime.job_input import open_input
    from heron_sdk.errors import HeronError

    put(b"", "present.jsonl")
    with pytest.raises(HeronError) as info:
        open_input(S3Location(BUCKET, "in/absent.jsonl"), "jsonl", "text", None, 4)
    assert (info.value.status, info.value.field) == (422, "input.uri")


def test_parquet_through_ranged_gets_of_many_blocks(put: Put,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 KiB: a RangedFile's kept blocks and its longer reads, on S3's answers."""
    from heron.runtime import job_sources
    from heron.runtime.job_input import open_input
    from tests.unit.test_job_input import check_shards, parquet_bytes, reference

    monkeypatch.setattr(job_sources, "S3_BLOCK", 4096)
    data = parquet_bytes(3000, 700)
    sharded = open_input(put(data, "p.parquet"), "parquet", "doc", "key", 256)
    try:
        check_shards(sharded, reference(data, "parquet", "doc", "key"))
    finally:
        sharded.close()
