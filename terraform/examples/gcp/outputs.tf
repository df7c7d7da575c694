output "cluster_name" {
  description = "Name of the GKE cluster: gcloud container clusters get-credentials <cluster_name> --region <region>."
  value       = module.heron.cluster_name
}

output "bucket_name" {
  description = "GCS bucket of the weight cache and the config store."
  value       = module.heron.bucket_name
}

output "weights_s3_url" {
  description = "HERON_WEIGHTS_S3 for the workers (with AWS_ENDPOINT_URL=https://storage.googleapis.com)."
  value       = module.heron.weights_s3_url
}

output "config_store_url" {
  description = "--store for the config service (with AWS_ENDPOINT_URL=https://storage.googleapis.com)."
  value       = module.heron.config_store_url
}

output "gsa_email" {
  description = "iam.gke.io/gcp-service-account annotation of the heron-worker and heron-config service accounts."
  value       = module.heron.gsa_email
}

output "hmac_access_id" {
  description = "AWS_ACCESS_KEY_ID for the bucket (null unless create_hmac_key)."
  value       = module.heron.hmac_access_id
}

output "hmac_secret" {
  description = "AWS_SECRET_ACCESS_KEY for the bucket (null unless create_hmac_key)."
  value       = module.heron.hmac_secret
  sensitive   = true
}
