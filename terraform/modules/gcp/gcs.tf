locals {
  bucket_name = coalesce(var.bucket_name, "${var.project_id}-${var.name}-heron")
}

# Weight cache (<cache_prefix>/) and config store (<config_prefix>/).
resource "google_storage_bucket" "this" {
  #checkov:skip=CKV_GCP_62:Access logs need a separate log bucket the operator owns; Cloud Audit Logs (data access) are the recommended trail.
  project  = var.project_id
  name     = local.bucket_name
  location = var.region

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = false

  versioning {
    enabled = true
  }

  # The weight cache is a cache: old versions go quickly.
  lifecycle_rule {
    condition {
      matches_prefix             = ["${var.cache_prefix}/"]
      with_state                 = "ARCHIVED"
      days_since_noncurrent_time = var.cache_noncurrent_days
    }
    action {
      type = "Delete"
    }
  }

  # The config store keeps its history for config_noncurrent_days.
  lifecycle_rule {
    condition {
      matches_prefix             = ["${var.config_prefix}/"]
      with_state                 = "ARCHIVED"
      days_since_noncurrent_time = var.config_noncurrent_days
    }
    action {
      type = "Delete"
    }
  }

  labels = local.labels
}
