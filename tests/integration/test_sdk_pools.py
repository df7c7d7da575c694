"""Pool leases through the SDK, against the session's cluster gateway and a real
nats-server: renewal keeps a pool past its TTL; leaving the block, or a renewer that
stops, ends it, and then routing to it ends too.

The pool's worker is a FakeWorker (tests/support/gateway_harness.py): it beats for the pool and
answers its work from the texts alone, so a vector tells which pool's worker made it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest

from heron_sdk import AsyncClient, Client, PoolError
from tests.support.gateway_harness import FakeWorker, fake_vector, unique
from tests.support.nats_server import NatsServer

BUNDLE = "test"  # the cluster fixture's bundle (tests/conftest.py)
TTL_S = 2.0


@pytest.fixture()
def pool_name(nats_server: NatsServer) -> Iterator[str]:
    """A fresh pool name with a worker already beating for it."""
    name = unique("lease")
    worker = FakeWorker(nats_server.url, name, BUNDLE).start()
    yield name
    worker.stop()


def test_renewal_keeps_the_pool_past_its_ttl_and_exit_ends_it(cluster_url: str,
                                                              pool_name: str) -> None:
    with Client(cluster_url, timeout=10) as client:
        with client.pool(pool_name, bundle=BUNDLE, ttl_s=TTL_S) as pool:
            assert pool.lease is not None and pool.lease["ttl_s"] == TTL_S
            deadline = time.monotonic() + 3 * TTL_S
            while time.monotonic() < deadline:  # three TTLs, routed to the pool all along
                out = pool.encode("minilm", ["routed to the lease"])
                np.testing.assert_array_equal(out[0].dense, fake_vector("routed to the lease"))
                time.sleep(0.25)
            assert pool.renewals >= 3 and not pool.lost
            assert client.get_pool(pool_name)["expires_in_s"] > 0
        # Leaving the block deleted the lease: the pool is gone and routing to it ends.
        with pytest.raises(PoolError) as gone:
            client.get_pool(pool_name)
        assert (gone.value.status, gone.value.code) == (404, "POOL_NOT_FOUND")
        with pytest.raises(PoolError):
            client.encode("minilm", ["after the lease"], pool=pool_name)
        # The static pool still serves the same model.
        assert client.encode("minilm", ["static pool"]).dense.shape == (1, 384)


def test_a_pool_whose_renewal_stops_expires_and_stops_routing(cluster_url: str,
                                                              pool_name: str) -> None:
    with Client(cluster_url, timeout=10) as client:
        pool = client.pool(pool_name, bundle=BUNDLE, ttl_s=TTL_S).__enter__()
        assert pool.encode("minilm", ["alive"]).dense.shape == (1, 2)
        pool.stop_renewing()  # as if the process holding the lease had died
        started = time.monotonic()
        while time.monotonic() - started < 4 * TTL_S:
            try:
                client.encode("minilm", ["still there?"], pool=pool_name)
            except PoolError as exc:
                assert exc.code == "POOL_NOT_FOUND"
                break
            time.sleep(0.1)
        else:
            pytest.fail("the lease never expired")
        lapsed = time.monotonic() - started
        assert TTL_S - 0.5 <= lapsed <= TTL_S + 2.5, lapsed
        assert pool_name not in [p["name"] for p in client.list_pools()]
        pool.close()  # deleting an expired pool is not an error


def test_async_pool_and_conflicts(cluster_url: str, pool_name: str) -> None:
    async def main() -> None:
        async with AsyncClient(cluster_url, timeout=10) as client:
            async with client.pool(pool_name, bundle=BUNDLE, ttl_s=TTL_S) as pool:
                await asyncio.sleep(1.5 * TTL_S)
                out = await pool.encode("minilm", ["async lease"])
                np.testing.assert_array_equal(out[0].dense, fake_vector("async lease"))
                assert pool.renewals >= 1
                with pytest.raises(PoolError) as taken:  # one lease per name
                    await client.create_pool(pool_name, BUNDLE)
                assert (taken.value.status, taken.value.code) == (409, "POOL_CONFLICT")
            with pytest.raises(PoolError):
                await client.get_pool(pool_name)

    asyncio.run(main())
