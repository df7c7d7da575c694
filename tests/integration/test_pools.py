"""Leased pools through the gateway: two real gateways on one real nats-server, real HTTP,
fake workers. Create/list/get/delete/renew, X-Heron-Pool routing, expiry ending routing
and demand, concurrent creates, and the provision probe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from heron.gateway.settings import GatewaySettings
from heron.runtime.nats_names import demand_subject
from heron_sdk import wire
from heron_sdk.pools import POOL_HEADER
from tests.integration.test_gateway_api import last_seq, metric
from tests.support import local_http
from tests.support.gateway_harness import (
    FakeWorker,
    GatewayThread,
    fake_vector,
    unique,
    write_bundles,
)
from tests.support.nats_server import NatsServer


@dataclass
class Gateways:
    a: GatewayThread
    b: GatewayThread
    nats_url: str
    static: dict[str, str]  # bundle -> static pool
    static_worker: FakeWorker  # answers in the static pool of bundle "pa"


@pytest.fixture(scope="module")
def gws(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Gateways]:
    root = write_bundles(tmp_path_factory.mktemp("pool-bundles"),
                         {"pa": ["dense", "rerank"], "pb": ["dense"]})
    static = {"pa": unique("static-a"), "pb": unique("static-b")}
    worker = FakeWorker(nats_server.url, static["pa"], "pa").start()
    settings = GatewaySettings(startup_grace_s=0.5)
    a = GatewayThread(nats_server.url, static, root, settings).start()
    b = GatewayThread(nats_server.url, static, root, settings).start()
    try:
        for gw in (a, b):  # the static worker's beats have arrived
            eventually(lambda gw=gw: local_http.get(gw.url + "/readyz").json()["pools"][
                static["pa"]]["healthy_workers"] == 1)
        yield Gateways(a, b, nats_server.url, static, worker)
    finally:
        a.stop()
        b.stop()
        worker.stop()


def create(gw: GatewayThread, name: str, bundle: str = "pa", **extra: Any) -> httpx.Response:
    return local_http.post(gw.url + "/v1/pools", json={"name": name, "bundle": bundle, **extra},
                           timeout=10)


def encode(gw: GatewayThread, pool: str | None, model: str = "pa-dense",
           text: str = "hello") -> httpx.Response:
    headers = {POOL_HEADER: pool} if pool is not None else {}
    return local_http.post(gw.url + f"/v1/encode/{model}", json={"items": [text]},
                           headers=headers, timeout=10)


def error(r: httpx.Response) -> tuple[int, str, str | None]:
    err = r.json()["error"]
    return r.status_code, err["code"], err.get("field")


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not true after {timeout_s}s"
        time.sleep(0.05)


def status_of(gw: GatewayThread, name: str) -> int:
    return local_http.get(gw.url + f"/v1/pools/{name}", timeout=5).status_code


# ---- the routes ------------------------------------------------------------------------------
def test_create_get_list_renew_delete(gws: Gateways) -> None:
    name = unique("team")
    r = create(gws.a, name, workers=2, ttl_s=30)
    assert r.status_code == 201, r.text
    lease = r.json()
    assert {k: lease[k] for k in ("name", "bundle", "workers", "ttl_s", "kind", "state",
                                  "healthy_workers")} == {
        "name": name, "bundle": "pa", "workers": 2, "ttl_s": 30.0, "kind": "lease",
        "state": "provisioning", "healthy_workers": 0}
    assert lease["expires_at"] == pytest.approx(lease["renewed_at"] + 30)
    assert 29 < lease["expires_in_s"] <= 30 and lease["created_at"] == lease["renewed_at"]

    got = local_http.get(gws.a.url + f"/v1/pools/{name}")  # read-your-write on the same gateway
    assert got.status_code == 200 and got.json()["expires_at"] == lease["expires_at"]
    listed = local_http.get(gws.a.url + "/v1/pools").json()
    assert listed["object"] == "list"
    by_name = {p["name"]: p for p in listed["data"]}
    assert by_name[name]["kind"] == "lease"
    assert by_name[gws.static["pa"]] == {"name": gws.static["pa"], "bundle": "pa",
                                         "kind": "static", "state": "ready",
                                         "healthy_workers": 1}
    assert by_name[gws.static["pb"]]["state"] == "provisioning"
    static = local_http.get(gws.b.url + f"/v1/pools/{gws.static['pa']}")
    assert static.status_code == 200 and static.json()["kind"] == "static"

    assert error(create(gws.a, name)) == (409, "POOL_CONFLICT", None)
    assert error(create(gws.b, gws.static["pb"], "pb")) == (409, "POOL_CONFLICT", None)

    renewed = local_http.post(gws.b.url + f"/v1/pools/{name}/renew", json={"ttl_s": 5})
    assert renewed.status_code == 200, renewed.text
    body = renewed.json()
    assert body["ttl_s"] == 5.0 and 4 < body["expires_in_s"] <= 5
    assert body["renewed_at"] > lease["renewed_at"] and body["created_at"] == lease["created_at"]
    kept = local_http.post(gws.a.url + f"/v1/pools/{name}/renew")  # no body: keeps its TTL
    assert kept.status_code == 200 and kept.json()["ttl_s"] == 5.0

    deleted = local_http.delete(gws.b.url + f"/v1/pools/{name}")
    assert deleted.status_code == 200 and deleted.json() == {"name": name, "deleted": True}
    assert error(local_http.get(gws.b.url + f"/v1/pools/{name}")) == (404, "POOL_NOT_FOUND", None)
    eventually(lambda: status_of(gws.a, name) == 404)
    assert name not in {p["name"] for p in local_http.get(gws.a.url + "/v1/pools").json()["data"]}
    assert error(local_http.delete(gws.a.url + f"/v1/pools/{name}")) == (404, "POOL_NOT_FOUND",
                                                                       None)
    # a deleted lease is never brought back by a renewal
    assert error(local_http.post(gws.a.url + f"/v1/pools/{name}/renew")) == (404, "POOL_NOT_FOUND",
                                                                        None)
    assert status_of(gws.a, name) == 404
    # static pools are not leases: they cannot be deleted or renewed
    static_name = gws.static["pa"]
    assert error(local_http.delete(gws.a.url + f"/v1/pools/{static_name}"))[:2] == (
        409, "POOL_CONFLICT")
    assert error(local_http.post(gws.a.url + f"/v1/pools/{static_name}/renew"))[:2] == (
        409, "POOL_CONFLICT")
    # the name is free again
    again = create(gws.b, name, ttl_s=5)
    assert again.status_code == 201, again.text
    assert local_http.delete(gws.b.url + f"/v1/pools/{name}").status_code == 200


@pytest.mark.parametrize(("body", "field"), [
    ({"bundle": "pa"}, "name"),
    ({"name": "Team A", "bundle": "pa"}, "name"),
    ({"name": "-team", "bundle": "pa"}, "name"),
    ({"name": "ok", "bundle": "nope"}, "bundle"),
    ({"name": "ok"}, "bundle"),
    ({"name": "ok", "bundle": "pa", "workers": -1}, "workers"),
    ({"name": "ok", "bundle": "pa", "workers": 1.5}, "workers"),
    ({"name": "ok", "bundle": "pa", "ttl_s": 0.5}, "ttl_s"),
    ({"name": "ok", "bundle": "pa", "ttl_s": "300"}, "ttl_s"),
    ({"name": "ok", "bundle": "pa", "replicas": 2}, "replicas"),
    (["ok"], "body"),
])
def test_bad_pool_bodies_are_422_naming_the_field(gws: Gateways, body: Any,
                                                  field: str) -> None:
    r = local_http.post(gws.a.url + "/v1/pools", json=body)
    assert error(r) == (422, "INVALID_FIELD", field)
    if field == "bundle" and isinstance(body, dict) and "bundle" in body:
        assert "known bundles: pa, pb" in r.json()["error"]["message"]


def test_bad_renew_bodies_and_malformed_json(gws: Gateways) -> None:
    name = unique("renew")
    assert create(gws.a, name, ttl_s=30).status_code == 201
    try:
        url = gws.a.url + f"/v1/pools/{name}/renew"
        assert error(local_http.post(url, json={"ttl_s": "long"})) == (422, "INVALID_FIELD",
                                                                  "ttl_s")
        assert error(local_http.post(url, json={"ttl_s": 10**6})) == (422, "INVALID_FIELD",
                                                                 "ttl_s")
        assert error(local_http.post(url, json={"workers": 3})) == (422, "INVALID_FIELD",
                                                                "workers")
        bad = local_http.post(gws.a.url + "/v1/pools", content=b"{not json",
                              headers={"content-type": "application/json"})
        assert error(bad)[:2] == (400, "MALFORMED_BODY")
        # none of it touched the lease
        assert local_http.get(gws.a.url + f"/v1/pools/{name}").json()["ttl_s"] == 30.0
    finally:
        local_http.delete(gws.a.url + f"/v1/pools/{name}")


# ---- routing ---------------------------------------------------------------------------------
def test_a_pool_created_on_one_gateway_is_listed_and_routed_by_another(gws: Gateways) -> None:
    name = unique("team")
    worker = FakeWorker(gws.nats_url, name, "pa").start()
    try:
        assert create(gws.a, name, ttl_s=60).status_code == 201
        eventually(lambda: status_of(gws.b, name) == 200)
        assert name in {p["name"] for p in local_http.get(gws.b.url + "/v1/pools").json()["data"]}
        eventually(lambda: local_http.get(gws.b.url + f"/v1/pools/{name}").json()["state"]
                   == "ready")

        static_seen = len(gws.static_worker.seen)
        r = encode(gws.b, name, text="pooled")
        assert r.status_code == 200, r.text
        assert r.json()["items"][0]["dense"] == fake_vector("pooled").tolist()
        assert len(worker.seen) == 1 and len(gws.static_worker.seen) == static_seen
        score = local_http.post(gws.a.url + "/v1/score/pa-rerank", headers={POOL_HEADER: name},
                                json={"query": "q", "items": ["a", "bb"]}, timeout=10)
        assert score.status_code == 200 and len(worker.seen) == 2
        openai = local_http.post(gws.b.url + "/v1/embeddings", headers={POOL_HEADER: name},
                                 json={"model": "pa-dense", "input": ["x"]}, timeout=10)
        assert openai.status_code == 200 and len(worker.seen) == 3
        assert len(gws.static_worker.seen) == static_seen

        # without the header the model's own (static) pool answers, as before
        plain = encode(gws.b, None)
        assert plain.status_code == 200 and len(gws.static_worker.seen) == static_seen + 1
        # naming the static pool explicitly is allowed too
        assert encode(gws.a, gws.static["pa"]).status_code == 200
        assert len(worker.seen) == 3

        ready = local_http.get(gws.b.url + "/readyz").json()["pools"]
        assert ready[name] == {"bundle": "pa", "kind": "lease", "healthy_workers": 1,
                               "outstanding_items": 0}
        assert ready[gws.static["pa"]]["kind"] == "static"
        text = local_http.get(gws.b.url + "/metrics").text
        assert metric(text, "heron_gateway_healthy_workers", pool=name) == 1
        assert metric(text, "heron_gateway_work_items_published_total", pool=name) >= 2
    finally:
        local_http.delete(gws.a.url + f"/v1/pools/{name}")
        worker.stop()


def test_unknown_pools_bad_headers_and_models_outside_the_pool(gws: Gateways) -> None:
    name = unique("only-pb")
    assert create(gws.a, name, "pb", ttl_s=30).status_code == 201
    try:
        unknown = encode(gws.a, unique("nobody"))
        assert error(unknown) == (404, "POOL_NOT_FOUND", None)
        assert error(encode(gws.a, "Not A Pool!")) == (422, "INVALID_FIELD", POOL_HEADER)
        outside = encode(gws.a, name, model="pa-dense")
        assert error(outside) == (404, "MODEL_NOT_FOUND", None)
        message = outside.json()["error"]["message"]
        assert f"not in bundle 'pb' served by pool '{name}'" in message
        # a static pool of another bundle: the same 404
        assert error(encode(gws.a, gws.static["pb"], model="pa-dense"))[:2] == (
            404, "MODEL_NOT_FOUND")
        # an unknown model is still the model's 404, header or not
        assert error(encode(gws.a, name, model="nope"))[:2] == (404, "MODEL_NOT_FOUND")
        assert last_seq(gws.nats_url, name) == 0  # nothing was published for any of these
    finally:
        local_http.delete(gws.a.url + f"/v1/pools/{name}")


def test_a_leased_pool_without_workers_is_202_and_publishes_demand(gws: Gateways) -> None:
    name = unique("cold")
    assert create(gws.a, name, ttl_s=30, workers=0).status_code == 201
    eventually(lambda: status_of(gws.b, name) == 200)

    async def go() -> tuple[httpx.Response, dict]:
        nc = await nats.connect(gws.nats_url)
        sub = await nc.subscribe(demand_subject(name))
        await nc.flush()  # the server has the subscription before the gateway publishes
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(gws.b.url + "/v1/encode/pa-dense",
                                      headers={POOL_HEADER: name}, json={"items": ["a"]})
            msg = await sub.next_msg(timeout=3)
            return r, wire.decode(msg.data, wire.MSGPACK)
        finally:
            await nc.close()

    try:
        r, demand = asyncio.run(go())
        assert r.status_code == 202, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["pool"] == name and r.json()["bundle"] == "pa"
        assert demand["pool"] == name and demand["bundle"] == "pa"
        text = local_http.get(gws.b.url + "/metrics").text
        assert metric(text, "heron_gateway_pending_demand", pool=name) >= 1
        assert last_seq(gws.nats_url, name) == 0
    finally:
        local_http.delete(gws.a.url + f"/v1/pools/{name}")
    # deleted: the demand for it ends at once, on every gateway
    eventually(lambda: f'pool="{name}"' not in local_http.get(gws.b.url + "/metrics").text)
    assert error(encode(gws.b, name)) == (404, "POOL_NOT_FOUND", None)


# ---- leases in time --------------------------------------------------------------------------
def test_renewal_keeps_a_lease_and_expiry_ends_routing_and_demand(gws: Gateways) -> None:
    name = unique("short")
    ttl = 2.0
    assert create(gws.a, name, ttl_s=ttl, workers=0).status_code == 201
    eventually(lambda: status_of(gws.b, name) == 200)
    assert encode(gws.b, name).status_code == 202  # demand for it, counted on gateway B
    started = time.monotonic()
    last_renewal = started
    while time.monotonic() - started < 3.5 * ttl:
        sent = time.monotonic()
        renewed = local_http.post(gws.a.url + f"/v1/pools/{name}/renew", timeout=5)
        assert renewed.status_code == 200, renewed.text
        last_renewal = sent  # the lease counts from before the answer came, not after
        assert status_of(gws.b, name) == 200 and status_of(gws.a, name) == 200
        time.sleep(ttl / 3)
    assert metric(local_http.get(gws.b.url + "/metrics").text, "heron_gateway_pending_demand",
                  pool=name) >= 1
    # No more renewals: it ends about ttl after the last one.
    eventually(lambda: status_of(gws.b, name) == 404, timeout_s=ttl + 3)
    assert time.monotonic() - last_renewal > ttl - 1.0
    eventually(lambda: status_of(gws.a, name) == 404, timeout_s=2)
    assert error(encode(gws.b, name)) == (404, "POOL_NOT_FOUND", None)
    for gw in (gws.a, gws.b):
        text = local_http.get(gw.url + "/metrics").text
        assert f'pool="{name}"' not in text  # no demand or worker gauge left
        assert name not in local_http.get(gw.url + "/readyz").json()["pools"]
    assert name not in gws.b.gateway.demand.pools()
    # expired is final: a renewal does not bring it back
    assert error(local_http.post(gws.a.url + f"/v1/pools/{name}/renew")) == (404, "POOL_NOT_FOUND",
                                                                        None)


def test_concurrent_creates_of_one_name_make_exactly_one_lease(gws: Gateways) -> None:
    name = unique("race")
    targets = [gws.a, gws.b] * 5
    with ThreadPoolExecutor(len(targets)) as pool:
        answers = list(pool.map(lambda gw: create(gw, name, ttl_s=30), targets))
    try:
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [201] + [409] * (len(targets) - 1), [r.text for r in answers]
        assert all(r.json()["error"]["code"] == "POOL_CONFLICT"
                   for r in answers if r.status_code == 409)
    finally:
        local_http.delete(gws.a.url + f"/v1/pools/{name}")


# ---- the provision probe -----------------------------------------------------------------------
def test_provision_probe(gws: Gateways) -> None:
    warm, cold = unique("warm"), unique("cold")
    worker = FakeWorker(gws.nats_url, warm, "pa", answer=False,
                        models={"pa/dense": "ready", "pa/rerank": "loading"}).start()
    try:
        assert create(gws.a, warm, ttl_s=30).status_code == 201
        assert create(gws.a, cold, ttl_s=30, workers=0).status_code == 201

        def probe(model: str, pool: str | None) -> httpx.Response:
            headers = {POOL_HEADER: pool} if pool else {}
            return local_http.post(gws.a.url + f"/v1/models/{model}/provision", headers=headers,
                                   timeout=10)

        eventually(lambda: probe("pa-dense", warm).status_code == 200)
        assert probe("pa/dense", warm).json() == {"model": "pa/dense", "pool": warm,
                                                  "state": "ready", "healthy_workers": 1}
        loading = probe("pa-rerank", warm)
        assert error(loading)[:2] == (503, "MODEL_LOADING")
        assert int(loading.headers["retry-after"]) >= 1
        # the static pool's worker beats but reports no model ready
        assert error(probe("pa-dense", None))[:2] == (503, "MODEL_LOADING")

        provisioning = probe("pa-dense", cold)
        assert provisioning.status_code == 202, provisioning.text
        assert provisioning.json()["status"] == "provisioning"
        assert provisioning.json()["pool"] == cold and provisioning.headers["retry-after"]
        assert metric(local_http.get(gws.a.url + "/metrics").text, "heron_gateway_pending_demand",
                      pool=cold) >= 1

        assert error(probe("nope", None))[:2] == (404, "MODEL_NOT_FOUND")
        assert error(probe("pb-dense", warm))[:2] == (404, "MODEL_NOT_FOUND")
        assert error(probe("pa-dense", unique("gone"))) == (404, "POOL_NOT_FOUND", None)
        # the model route is still the model route
        assert local_http.get(gws.a.url + "/v1/models/pa-dense").json()["id"] == "pa/dense"
        assert last_seq(gws.nats_url, warm) == 0  # a probe queues nothing
    finally:
        for name in (warm, cold):
            local_http.delete(gws.a.url + f"/v1/pools/{name}")
        worker.stop()


# ---- NATS restarts ---------------------------------------------------------------------------
def test_gateways_follow_the_bucket_across_a_nats_restart(tmp_path: Path) -> None:
    own = NatsServer(tmp_path / "nats").start()
    root = write_bundles(tmp_path / "bundles", {"pa": ["dense"]})
    static = {"pa": unique("static")}
    name = unique("team")
    a = GatewayThread(own.url, static, root).start()
    b = GatewayThread(own.url, static, root).start()
    worker = None
    try:
        assert create(a, name, ttl_s=60).status_code == 201
        eventually(lambda: status_of(b, name) == 200)
        own.stop()
        own.start()  # same store: the lease is still there
        for gw in (a, b):
            eventually(lambda gw=gw: local_http.get(gw.url + "/readyz").status_code == 200, 15)
        worker = FakeWorker(own.url, name, "pa").start()
        eventually(lambda: encode(b, name).status_code == 200, 10)
        assert local_http.delete(a.url + f"/v1/pools/{name}").status_code == 200
        eventually(lambda: status_of(b, name) == 404)  # b's watcher runs again
        assert error(encode(b, name)) == (404, "POOL_NOT_FOUND", None)
    finally:
        a.stop()
        b.stop()
        if worker is not None:
            worker.stop()
        own.stop()
