# IAM roles for service accounts (IRSA): the worker and the config service pods get AWS
# credentials for their own prefix of the bucket, and nothing else.

data "tls_certificate" "oidc" {
  url = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

resource "aws_iam_openid_connect_provider" "this" {
  url             = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list  = ["sts.amazonaws.com"]
  thumbprint_list = [data.tls_certificate.oidc.certificates[0].sha1_fingerprint]
  tags            = local.tags
}

locals {
  oidc_issuer = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")

  # role key => the one service account that may assume it, and the bucket prefix it may use
  irsa = {
    worker = { service_account = var.worker_service_account, prefix = var.cache_prefix }
    config = { service_account = var.config_service_account, prefix = var.config_prefix }
  }
}

data "aws_iam_policy_document" "irsa_assume" {
  for_each = local.irsa

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [aws_iam_openid_connect_provider.this.arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${each.value.service_account}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "irsa" {
  for_each = local.irsa

  name               = "${var.name}-${each.key}" # heron-worker, heron-config by default
  assume_role_policy = data.aws_iam_policy_document.irsa_assume[each.key].json
  tags               = local.tags
}

data "aws_iam_policy_document" "irsa" {
  for_each = local.irsa

  statement {
    sid       = "ListOwnPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${each.value.prefix}/*", "${each.value.prefix}"]
    }
  }

  statement {
    sid = "ReadWriteOwnPrefix"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = ["${aws_s3_bucket.this.arn}/${each.value.prefix}/*"]
  }

  statement {
    sid       = "UseBucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "irsa" {
  for_each = local.irsa

  name   = "heron-bucket"
  role   = aws_iam_role.irsa[each.key].id
  policy = data.aws_iam_policy_document.irsa[each.key].json
}
