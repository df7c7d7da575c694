output "cluster_name" {
  description = "Name of the EKS cluster: aws eks update-kubeconfig --name <cluster_name> --region <region>."
  value       = module.heron.cluster_name
}

output "bucket_name" {
  description = "S3 bucket of the weight cache and the config store."
  value       = module.heron.bucket_name
}

output "weights_s3_url" {
  description = "HERON_WEIGHTS_S3 for the workers."
  value       = module.heron.weights_s3_url
}

output "config_store_url" {
  description = "--store for the config service."
  value       = module.heron.config_store_url
}

output "worker_role_arn" {
  description = "eks.amazonaws.com/role-arn annotation of the heron-worker service account."
  value       = module.heron.worker_role_arn
}

output "config_role_arn" {
  description = "eks.amazonaws.com/role-arn annotation of the heron-config service account."
  value       = module.heron.config_role_arn
}
