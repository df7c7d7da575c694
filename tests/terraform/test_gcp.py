"""What an operator checks in the GKE module before applying it."""

from __future__ import annotations

from .conftest import one


def test_gpu_pool_scales_to_zero_with_accelerator_and_taint(gcp):
    gpu = gcp["resource.google_container_node_pool"]["gpu"]
    assert one(gpu["autoscaling"])["min_node_count"] == 0
    assert gpu["initial_node_count"] == 0
    node = one(gpu["node_config"])
    accelerator = one(node["guest_accelerator"])
    assert accelerator["type"] == "${var.gpu_accelerator_type}"
    assert accelerator["count"] == "${var.gpu_accelerator_count}"
    taint = one(node["taint"])
    assert (taint["key"], taint["effect"]) == ("nvidia.com/gpu", "NO_SCHEDULE")
    assert "var.gpu_node_labels" in node["labels"]


def test_cpu_pool_is_untainted_and_keeps_a_node(gcp):
    cpu = gcp["resource.google_container_node_pool"]["cpu"]
    node = one(cpu["node_config"])
    assert "taint" not in node and "guest_accelerator" not in node
    assert gcp["variable"]["cpu_min_nodes"]["default"] >= 1


def test_pods_use_workload_identity(gcp):
    cluster = gcp["resource.google_container_cluster"]["this"]
    assert one(cluster["workload_identity_config"])["workload_pool"] == (
        "${var.project_id}.svc.id.goog"
    )
    for pool in gcp["resource.google_container_node_pool"].values():
        node = one(pool["node_config"])
        assert one(node["workload_metadata_config"])["mode"] == "GKE_METADATA"
        assert node["service_account"] == "${google_service_account.nodes.email}"


def test_bucket_is_private_uniform_and_versioned(gcp):
    bucket = gcp["resource.google_storage_bucket"]["this"]
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert one(bucket["versioning"])["enabled"] is True
    prefixes = [p for r in bucket["lifecycle_rule"] for p in one(r["condition"])["matches_prefix"]]
    assert "${var.cache_prefix}/" in prefixes


def test_workload_identity_binds_only_heron_service_accounts(gcp):
    binding = gcp["resource.google_service_account_iam_member"]["workload_identity"]
    assert binding["role"] == "roles/iam.workloadIdentityUser"
    assert binding["service_account_id"] == "${google_service_account.heron.name}"
    assert binding["member"] == (
        "serviceAccount:${var.project_id}.svc.id.goog[${var.namespace}/${each.value}]"
    )
    assert "var.worker_service_account" in binding["for_each"]


def test_bucket_iam_is_object_level_on_the_heron_bucket(gcp):
    members = gcp["resource.google_storage_bucket_iam_member"]
    assert list(members) == ["heron"]
    member = members["heron"]
    assert member["bucket"] == "${google_storage_bucket.this.name}"
    assert member["role"] == "roles/storage.objectUser"
    assert member["member"] == "serviceAccount:${google_service_account.heron.email}"
    # Project-level roles go to the node service account only (logs, metrics, image pulls),
    # never to Heron's, and none of them administers anything.
    for body in gcp["resource.google_project_iam_member"].values():
        assert body["member"] == "serviceAccount:${google_service_account.nodes.email}"
        assert "admin" not in body["for_each"].lower()
        assert "roles/owner" not in body["for_each"] and "roles/editor" not in body["for_each"]


def test_hmac_key_is_opt_in(gcp):
    """The HMAC key's secret lands in the Terraform state: only on request."""
    assert gcp["variable"]["create_hmac_key"]["default"] is False
    key = gcp["resource.google_storage_hmac_key"]["heron"]
    assert key["count"] == "${var.create_hmac_key ? 1 : 0}"
    assert key["service_account_email"] == "${google_service_account.heron.email}"
    assert gcp["output"]["hmac_secret"]["sensitive"] is True
