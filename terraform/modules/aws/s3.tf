locals {
  bucket_name = coalesce(var.bucket_name, "${var.name}-heron-${data.aws_caller_identity.current.account_id}")
}

# Weight cache (s3://<bucket>/<cache_prefix>) and config store (s3://<bucket>/<config_prefix>).
resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Access logging needs a separate log bucket the operator owns; CloudTrail data events are the recommended audit trail for this bucket.
  #checkov:skip=CKV_AWS_144:Cross-region replication is a DR choice: the weight cache refills from the Hub, and the config store is versioned.
  #checkov:skip=CKV2_AWS_62:Heron consumes no S3 event notifications.
  bucket = local.bucket_name
  tags   = local.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    object_ownership = "BucketOwnerEnforced" # ACLs off
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

# Deny any request that is not TLS.
data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # Uploads that broke off (a worker killed mid-fill) are removed after a day, bucket-wide.
  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  # The weight cache is a cache: old versions go quickly, objects optionally expire.
  rule {
    id     = "weight-cache"
    status = "Enabled"
    filter {
      prefix = "${var.cache_prefix}/"
    }
    noncurrent_version_expiration {
      noncurrent_days = var.cache_noncurrent_days
    }
    dynamic "expiration" {
      for_each = var.cache_expiration_days > 0 ? [var.cache_expiration_days] : []
      content {
        days = expiration.value
      }
    }
  }

  # The config store keeps its history for config_noncurrent_days.
  rule {
    id     = "config-store"
    status = "Enabled"
    filter {
      prefix = "${var.config_prefix}/"
    }
    noncurrent_version_expiration {
      noncurrent_days = var.config_noncurrent_days
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}
