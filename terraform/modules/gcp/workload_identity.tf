# Workload Identity: the worker and config service pods act as one Google service account
# that may use objects in the Heron bucket, and nothing else.

resource "google_service_account" "heron" {
  project      = var.project_id
  account_id   = "${var.name}-heron"
  display_name = "Heron ${var.name} workers and config service"
}

# Only these two Kubernetes service accounts may impersonate it.
resource "google_service_account_iam_member" "workload_identity" {
  for_each = toset([var.worker_service_account, var.config_service_account])

  service_account_id = google_service_account.heron.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${var.namespace}/${each.value}]"

  depends_on = [google_container_cluster.this] # the workload pool exists with the cluster
}

# Objects only (read, write, delete); no bucket administration.
resource "google_storage_bucket_iam_member" "heron" {
  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.heron.email}"
}

# boto3 speaks to GCS's S3-compatible XML API with an HMAC key (AWS_ACCESS_KEY_ID /
# AWS_SECRET_ACCESS_KEY). Opt-in, because its secret is stored in the Terraform state.
resource "google_storage_hmac_key" "heron" {
  count = var.create_hmac_key ? 1 : 0

  project               = var.project_id
  service_account_email = google_service_account.heron.email
}
