output "cluster_name" {
  description = "Name of the EKS cluster (aws eks update-kubeconfig --name <cluster_name>)."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "URL of the Kubernetes API server."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64 CA certificate of the Kubernetes API server."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "oidc_provider_arn" {
  description = "ARN of the cluster's IAM OIDC provider (for further IRSA roles, e.g. the cluster autoscaler)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "bucket_name" {
  description = "Name of the S3 bucket holding the weight cache and the config store."
  value       = aws_s3_bucket.this.id
}

output "weights_s3_url" {
  description = "Value for HERON_WEIGHTS_S3 on the workers."
  value       = "s3://${aws_s3_bucket.this.id}/${var.cache_prefix}"
}

output "config_store_url" {
  description = "Value for the config service's --store."
  value       = "s3://${aws_s3_bucket.this.id}/${var.config_prefix}"
}

output "worker_role_arn" {
  description = "IAM role of the worker service account: its eks.amazonaws.com/role-arn annotation."
  value       = aws_iam_role.irsa["worker"].arn
}

output "config_role_arn" {
  description = "IAM role of the config service's service account: its eks.amazonaws.com/role-arn annotation."
  value       = aws_iam_role.irsa["config"].arn
}

output "kms_key_arn" {
  description = "ARN of the KMS key encrypting the bucket and the cluster's secrets."
  value       = aws_kms_key.this.arn
}
