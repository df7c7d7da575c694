"""Config service end to end on a real nats-server and a directory store: writes, deltas,
append-only rules, idempotency, bad input (store untouched), auth, restart, crash repair."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from heron.config_service.blobs import DirBlobs
from heron.config_service.body import parse_posted
from heron.config_service.state import Registry
from heron.config_service.store import ConfigStore, change_key
from heron.runtime.nats_names import config_all_subject, config_subject
from tests.support.config_procs import (
    ADMIN,
    InProcessConfig,
    model_body,
    own_nats,
    read_deltas,
    write_bundles,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def nats_url(tmp_path: Path) -> Iterator[str]:
    yield from own_nats(tmp_path)


@pytest.fixture()
def bundles_dir(tmp_path: Path) -> Path:
    return write_bundles(tmp_path / "bundles")


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture()
def service(nats_url: str, store: Path, bundles_dir: Path) -> Iterator[InProcessConfig]:
    svc = InProcessConfig(nats_url, store, bundles_dir).start()
    yield svc
    svc.stop()


def store_files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file()}


def test_post_new_model_publishes_deltas(service: InProcessConfig, nats_url: str,
                                         store: Path) -> None:
    before = service.get("/v1/configs/epoch").json()
    assert before["epoch"] == 0
    r = service.post(model_body())
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "org/new-dense", "epoch": 1, "bundles": ["alpha", "beta"],
                        "created": True}
    after = service.get("/v1/configs/epoch").json()
    assert after["epoch"] == 1
    assert after["bundles_hash"]["sparsebox"] == before["bundles_hash"]["sparsebox"]
    assert after["bundles_hash"]["alpha"] != before["bundles_hash"]["alpha"]
    model = service.get("/v1/configs/models/org/new-dense").json()["model"]
    for subject in (config_subject("alpha"), config_subject("beta"), config_all_subject()):
        [(headers, delta)] = read_deltas(nats_url, subject, expect=1)
        assert headers["Nats-Msg-Id"] == f"1-{subject}"
        assert delta["epoch"] == 1 and delta["model"] == model
        assert delta["bundles"] == ["alpha", "beta"]
        assert delta["bundles_hash"] == {b: after["bundles_hash"][b] for b in ("alpha", "beta")}
    assert read_deltas(nats_url, config_subject("sparsebox"), timeout_s=0.5) == []
    export = service.get("/v1/configs/export").json()
    assert export["epoch"] == 1 and export["models"]["org/new-dense"] == model
    assert export["bundles"]["alpha"]["models"] == ["base/dense", "org/new-dense"]
    assert export["bundles"]["alpha"]["hash"] == after["bundles_hash"]["alpha"]
    bundle = service.get("/v1/configs/bundles/beta").json()
    assert bundle["models"] == ["base/beta", "org/new-dense"]
    listing = service.get("/v1/configs/models").json()
    assert listing["epoch"] == 1
    assert {m["id"] for m in listing["models"]} == {"base/dense", "base/beta", "base/sparse",
                                                    "org/new-dense"}
    journal = json.loads((store / "journal.json").read_text())
    assert journal["entries"] == [{"epoch": 1, "id": "org/new-dense", "published": True}]
    metrics = service.get("/metrics").text
    assert "heron_config_epoch 1.0" in metrics and "heron_config_is_leader 1.0" in metrics


def test_append_only_rules(service: InProcessConfig, nats_url: str) -> None:
    assert service.post(model_body()).status_code == 201
    again = service.post(yaml.safe_dump(model_body()).encode(), content_type="application/yaml")
    assert again.status_code == 200, again.text
    assert again.json() == {"id": "org/new-dense", "epoch": 1, "bundles": ["alpha", "beta"],
                            "created": False}
    assert service.get("/v1/configs/epoch").json()["epoch"] == 1

    conflict = model_body(source={"hub": "org/other"})
    conflict["profiles"]["default"]["max_batch_tokens"] = 8192
    r = service.post(conflict)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "CONTENT_CONFLICT"
    assert error["fields"] == ["source.hub", "profiles.default.max_batch_tokens"]
    assert "source.hub" in error["message"]

    extended = model_body()
    extended["profiles"]["fast"] = {"max_batch_tokens": 1024, "precision": "fp16"}
    r = service.post(extended)
    assert r.status_code == 201, r.text
    assert r.json()["epoch"] == 2
    model = service.get("/v1/configs/models/org/new-dense").json()
    assert sorted(model["model"]["profiles"]) == ["default", "fast"]
    assert model["epoch"] == 2
    # Re-posting only the default profile is not a removal: still a no-op.
    assert service.post(model_body()).status_code == 200
    # Routing it to one more bundle explicitly is an addition... of a known bundle only.
    assert service.post(model_body(bundles=["sparsebox"])).status_code == 422
    [(_, delta)] = [d for d in read_deltas(nats_url, config_all_subject(), expect=2)
                    if d[1]["epoch"] == 2]
    assert sorted(delta["model"]["profiles"]) == ["default", "fast"]
    # A new model with an existing model's alias clashes.
    r = service.post(model_body("org/third", aliases=["base/dense"]))
    assert r.status_code == 409 and r.json()["error"]["field"] == "aliases"
    # Explicit bundles restrict routing.
    r = service.post(model_body("org/only-beta", bundles=["beta"]))
    assert r.status_code == 201 and r.json()["bundles"] == ["beta"]


def test_idempotency_key(service: InProcessConfig) -> None:
    key = {"Idempotency-Key": "k-1"}
    first = service.post(model_body(), headers=key)
    assert first.status_code == 201
    replay = service.post(model_body(), headers=key)
    assert (replay.status_code, replay.json()) == (201, first.json())
    other = service.post(model_body("org/other"), headers=key)
    assert other.status_code == 409 and other.json()["error"]["code"] == "CONTENT_CONFLICT"
    assert service.post(model_body(), headers={"Idempotency-Key": "k-2"}).status_code == 200
    assert service.get("/v1/configs/epoch").json()["epoch"] == 1


def _bad_cases() -> list[tuple[str, bytes, str, dict[str, str], int, str, str | None]]:
    """(name, body, content type, headers, status, code, field)."""
    def js(body: object) -> bytes:
        return json.dumps(body).encode()

    no_source = model_body()
    del no_source["source"]
    no_id = model_body()
    del no_id["id"]
    bad_profile = model_body()
    bad_profile["profiles"]["default"]["max_batch_tokens"] = -1
    bomb = b"a: &a [x, x]\nb: &b [*a, *a]\nid: *b\n"
    return [
        ("invalid yaml", b"id: [unclosed\nadapter: dense", "application/yaml", {}, 400,
         "MALFORMED_BODY", None),
        ("invalid json", b'{"id": ', "application/json", {}, 400, "MALFORMED_BODY", None),
        ("yaml aliases", bomb, "application/yaml", {}, 400, "MALFORMED_BODY", None),
        ("not a mapping", js(["x"]), "application/json", {}, 400, "MALFORMED_BODY", None),
        ("media type", b"<html/>", "text/html", {}, 415, "UNSUPPORTED_MEDIA_TYPE", None),
        ("unknown adapter", js(model_body(adapter="nope")), "application/json", {}, 422,
         "INVALID_FIELD", "adapter"),
        ("missing source", js(no_source), "application/json", {}, 422, "INVALID_FIELD",
         "source"),
        ("missing id", js(no_id), "application/json", {}, 422, "INVALID_FIELD", "id"),
        ("unknown field", js(model_body(colour="red")), "application/json", {}, 422,
         "INVALID_FIELD", "colour"),
        ("bad profile", js(bad_profile), "application/json", {}, 422, "INVALID_FIELD",
         "profiles.default.max_batch_tokens"),
        ("dotdot id", js(model_body("../x")), "application/json", {}, 422, "INVALID_FIELD",
         "id"),
        ("space id", js(model_body("a b")), "application/json", {}, 422, "INVALID_FIELD", "id"),
        ("leading slash", js(model_body("/abs")), "application/json", {}, 422,
         "INVALID_FIELD", "id"),
        ("long id", js(model_body("x" * 201)), "application/json", {}, 422, "INVALID_FIELD",
         "id"),
        ("bad alias", js(model_body(aliases=["ok", "../up"])), "application/json", {}, 422,
         "INVALID_FIELD", "aliases[1]"),
        ("unknown bundle", js(model_body(bundles=["nope"])), "application/json", {}, 422,
         "INVALID_FIELD", "bundles"),
        ("bundle excludes adapter", js(model_body(bundles=["sparsebox"])),
         "application/json", {}, 422, "INVALID_FIELD", "bundles"),
        ("oversize", b"#" * ((1 << 20) + 1), "application/yaml", {}, 413,
         "PAYLOAD_TOO_LARGE", None),
        ("no token", js(model_body()), "application/json", {"Authorization": ""}, 401,
         "UNAUTHORIZED", None),
        ("wrong token", js(model_body()), "application/json",
         {"Authorization": "Bearer not-it"}, 403, "FORBIDDEN", None),
        ("conflict", js(model_body("base/dense")), "application/json", {}, 409,
         "CONTENT_CONFLICT", "profiles.default.max_batch_tokens"),
    ]


def test_bad_input_leaves_store_unchanged(service: InProcessConfig, store: Path) -> None:
    assert service.post(model_body("org/existing")).status_code == 201
    files = store_files(store)
    for name, body, ctype, headers, status, code, field in _bad_cases():
        r = service.post(body, content_type=ctype, headers=headers)
        assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
        error = r.json()["error"]
        assert error["code"] == code, f"{name}: {error}"
        if field is not None:
            assert error["field"] == field, f"{name}: {error}"
            assert field in error["message"], f"{name}: {error}"
        assert store_files(store) == files, f"{name} changed the store"
        assert service.get("/v1/configs/epoch").json()["epoch"] == 1, name


def test_auth_guards_writes_and_export_only(service: InProcessConfig) -> None:
    open_paths = ["/healthz", "/readyz", "/v1/configs/models", "/v1/configs/epoch",
                  "/v1/configs/bundles", "/v1/configs/bundles/alpha",
                  "/v1/configs/models/base/dense", "/metrics"]
    for path in open_paths:
        assert service.get(path, headers={}).status_code == 200, path
    assert service.get("/v1/configs/export", headers={}).status_code == 401
    r = service.get("/v1/configs/export", headers={"Authorization": "Bearer api-key-1"})
    assert r.status_code == 403
    assert service.get("/v1/configs/export").status_code == 200
    assert service.get("/v1/configs/models/no/such", headers={}).status_code == 404
    assert service.get("/v1/configs/bundles/nope", headers={}).status_code == 404


def test_restart_keeps_models_and_epoch(nats_url: str, store: Path, bundles_dir: Path) -> None:
    first = InProcessConfig(nats_url, store, bundles_dir).start()
    try:
        assert first.post(model_body("org/a")).status_code == 201
        extended = model_body("org/a")
        extended["profiles"]["long"] = {"max_sequence_length": 512}
        assert first.post(extended).status_code == 201
        assert first.post(model_body("org/b")).status_code == 201
        export = first.get("/v1/configs/export").json()
    finally:
        first.stop()
    second = InProcessConfig(nats_url, store, bundles_dir).start()
    try:
        assert second.get("/v1/configs/export").json() == export
        r = second.post(model_body("org/c"))
        assert r.status_code == 201 and r.json()["epoch"] == 4
        epochs = [d["epoch"] for _, d in read_deltas(nats_url, config_all_subject(), expect=4)]
        assert epochs == [1, 2, 3, 4]
    finally:
        second.stop()


def test_crash_between_store_write_and_publish_is_repaired(
        nats_url: str, store: Path, bundles_dir: Path) -> None:
    """A store committed (journal entry published: false) with nothing on NATS, plus an
    orphan change file from a crash before its journal write: a fresh instance publishes
    the first and drops the second."""
    registry = Registry.from_bundles_dir(bundles_dir)
    config_store = ConfigStore(DirBlobs(store))
    change = registry.plan(parse_posted(model_body("org/crashed")).model, None)
    assert change is not None
    journal = config_store.commit(config_store.read_journal(), change)
    assert journal.unpublished()[0].id == "org/crashed"
    registry.apply(change)
    orphan = registry.plan(parse_posted(model_body("org/orphan")).model, None)
    assert orphan is not None
    DirBlobs(store).write(change_key(orphan.epoch), b'{"half": "written"}')
    assert read_deltas(nats_url, config_all_subject(), timeout_s=0.5) == []

    service = InProcessConfig(nats_url, store, bundles_dir).start()
    try:
        [(headers, delta)] = read_deltas(nats_url, config_all_subject(), expect=1)
        assert headers["Nats-Msg-Id"] == f"1-{config_all_subject()}"
        assert delta["epoch"] == 1 and delta["model"]["id"] == "org/crashed"
        assert delta["bundles_hash"] == change.bundles_hash
        assert len(read_deltas(nats_url, config_subject("alpha"), expect=1)) == 1
        journal_json = json.loads((store / "journal.json").read_text())
        assert journal_json["entries"][0]["published"] is True
        assert not (store / change_key(2)).exists()
        assert service.get("/v1/configs/epoch").json()["epoch"] == 1
        r = service.post(model_body("org/after"))
        assert r.status_code == 201 and r.json()["epoch"] == 2
    finally:
        service.stop()


def test_open_writes_without_admin_token(nats_url: str, store: Path, bundles_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_ADMIN_TOKEN", raising=False)
    service = InProcessConfig(nats_url, store, bundles_dir, admin_token=None).start()
    try:
        assert service.post(model_body()).status_code == 201
        assert service.get("/v1/configs/export").status_code == 200
    finally:
        service.stop()
    monkeypatch.setenv("HERON_ADMIN_TOKEN", ADMIN)
    guarded = InProcessConfig(nats_url, store, bundles_dir, admin_token=None).start()
    try:  # the env var is the default
        guarded.headers = {}
        assert guarded.post(model_body("org/x")).status_code == 401
    finally:
        guarded.stop()
