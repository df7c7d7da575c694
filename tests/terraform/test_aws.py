"""What an operator checks in the EKS module before applying it."""

from __future__ import annotations

import json

from .conftest import one


def test_gpu_node_group_scales_to_zero_and_is_tainted(aws):
    gpu = aws["resource.aws_eks_node_group"]["gpu"]
    scaling = one(gpu["scaling_config"])
    assert scaling["min_size"] == 0
    assert scaling["desired_size"] == 0
    assert scaling["max_size"] == "${var.gpu_max_size}"
    assert "NVIDIA" in gpu["ami_type"]
    taint = one(gpu["taint"])
    assert (taint["key"], taint["effect"]) == ("nvidia.com/gpu", "NO_SCHEDULE")
    assert gpu["labels"] == "${var.gpu_node_labels}"
    assert aws["variable"]["gpu_node_labels"]["default"]
    # Scale-from-zero: the autoscaler learns the taint of a node that does not exist yet.
    asg_tags = aws["locals"]["gpu_asg_tags"]
    assert "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu" in asg_tags
    asg_tag = aws["resource.aws_autoscaling_group_tag"]["gpu"]
    assert asg_tag["for_each"] == "${local.gpu_asg_tags}"
    assert "aws_eks_node_group.gpu" in asg_tag["autoscaling_group_name"]


def test_cpu_node_group_is_untainted_and_keeps_a_node(aws):
    cpu = aws["resource.aws_eks_node_group"]["cpu"]
    assert "taint" not in cpu
    assert one(cpu["scaling_config"])["min_size"] == "${var.cpu_min_size}"
    assert aws["variable"]["cpu_min_size"]["default"] >= 1


def test_bucket_blocks_public_access(aws):
    block = aws["resource.aws_s3_bucket_public_access_block"]["this"]
    assert block["bucket"] == "${aws_s3_bucket.this.id}"
    for key in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                "restrict_public_buckets"):
        assert block[key] is True, key


def test_bucket_is_encrypted_versioned_and_tls_only(aws):
    sse = aws["resource.aws_s3_bucket_server_side_encryption_configuration"]["this"]
    default = one(one(sse["rule"])["apply_server_side_encryption_by_default"])
    assert default["sse_algorithm"] == "aws:kms"
    assert default["kms_master_key_id"] == "${aws_kms_key.this.arn}"
    assert aws["resource.aws_kms_key"]["this"]["enable_key_rotation"] is True
    versioning = aws["resource.aws_s3_bucket_versioning"]["this"]
    assert one(versioning["versioning_configuration"])["status"] == "Enabled"
    deny = one(aws["data.aws_iam_policy_document"]["bucket"]["statement"])
    assert deny["effect"] == "Deny"
    assert one(deny["condition"])["variable"] == "aws:SecureTransport"


def test_lifecycle_covers_the_cache_prefix(aws):
    rules = aws["resource.aws_s3_bucket_lifecycle_configuration"]["this"]["rule"]
    by_prefix = {one(r["filter"]).get("prefix"): r for r in rules}
    cache = by_prefix["${var.cache_prefix}/"]
    assert cache["status"] == "Enabled"
    assert one(cache["noncurrent_version_expiration"])["noncurrent_days"] == (
        "${var.cache_noncurrent_days}"
    )
    assert any("abort_incomplete_multipart_upload" in r for r in rules)


def test_irsa_trust_is_scoped_to_the_worker_service_account(aws):
    irsa = aws["locals"]["irsa"]
    assert irsa["worker"]["service_account"] == "${var.worker_service_account}"
    assert aws["variable"]["worker_service_account"]["default"] == "heron-worker"

    assume = aws["data.aws_iam_policy_document"]["irsa_assume"]
    assert assume["for_each"] == "${local.irsa}"
    statement = one(assume["statement"])
    assert statement["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    principal = one(statement["principals"])
    assert principal["identifiers"] == ["${aws_iam_openid_connect_provider.this.arn}"]
    conditions = {c["variable"]: c for c in statement["condition"]}
    sub = conditions["${local.oidc_issuer}:sub"]
    # StringEquals on one exact subject: no wildcard can match another service account.
    assert sub["test"] == "StringEquals"
    assert sub["values"] == [
        "system:serviceaccount:${var.namespace}:${each.value.service_account}"
    ]
    assert conditions["${local.oidc_issuer}:aud"]["values"] == ["sts.amazonaws.com"]
    role = aws["resource.aws_iam_role"]["irsa"]
    assert role["assume_role_policy"] == (
        "${data.aws_iam_policy_document.irsa_assume[each.key].json}"
    )


def test_irsa_policy_is_limited_to_the_bucket(aws):
    statements = aws["data.aws_iam_policy_document"]["irsa"]["statement"]
    resources = [r for s in statements for r in s["resources"]]
    assert resources
    allowed = ("${aws_s3_bucket.this.arn}", "${aws_kms_key.this.arn}")
    for resource in resources:
        assert resource.startswith(allowed), resource
    actions = [a for s in statements for a in s["actions"]]
    assert not [a for a in actions if a.endswith("*")], actions
    writes = next(s for s in statements if "s3:PutObject" in s["actions"])
    assert writes["resources"] == ["${aws_s3_bucket.this.arn}/${each.value.prefix}/*"]


def test_cluster_encrypts_secrets_and_logs(aws):
    cluster = aws["resource.aws_eks_cluster"]["this"]
    assert one(cluster["encryption_config"])["resources"] == ["secrets"]
    assert "audit" in cluster["enabled_cluster_log_types"]
    assert aws["variable"]["endpoint_public_access"]["default"] is False
    assert json.dumps(aws["variable"]["public_access_cidrs"]["default"]) == "[]"
