output "cluster_name" {
  description = "Name of the GKE cluster (gcloud container clusters get-credentials <cluster_name> --region <region>)."
  value       = google_container_cluster.this.name
}

output "cluster_endpoint" {
  description = "IP address of the Kubernetes API server."
  value       = google_container_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64 CA certificate of the Kubernetes API server."
  value       = google_container_cluster.this.master_auth[0].cluster_ca_certificate
}

output "bucket_name" {
  description = "Name of the GCS bucket holding the weight cache and the config store."
  value       = google_storage_bucket.this.name
}

output "weights_s3_url" {
  description = "Value for HERON_WEIGHTS_S3 on the workers, with AWS_ENDPOINT_URL=https://storage.googleapis.com (GCS's S3-compatible XML API)."
  value       = "s3://${google_storage_bucket.this.name}/${var.cache_prefix}"
}

output "config_store_url" {
  description = "Value for the config service's --store, with AWS_ENDPOINT_URL=https://storage.googleapis.com."
  value       = "s3://${google_storage_bucket.this.name}/${var.config_prefix}"
}

output "gsa_email" {
  description = "Google service account of the workers and the config service: the iam.gke.io/gcp-service-account annotation of their Kubernetes service accounts."
  value       = google_service_account.heron.email
}

output "hmac_access_id" {
  description = "AWS_ACCESS_KEY_ID for GCS's S3-compatible API (null unless create_hmac_key)."
  value       = var.create_hmac_key ? google_storage_hmac_key.heron[0].access_id : null
}

output "hmac_secret" {
  description = "AWS_SECRET_ACCESS_KEY for GCS's S3-compatible API (null unless create_hmac_key). Put it in a Kubernetes Secret."
  value       = var.create_hmac_key ? google_storage_hmac_key.heron[0].secret : null
  sensitive   = true
}
