variable "name" {
  description = "Name of the EKS cluster; also the prefix of every other resource's name."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters: lower-case letters, digits and '-', starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes version of the EKS control plane, e.g. \"1.31\"."
  type        = string
  default     = "1.31"
}

variable "subnet_ids" {
  description = "Private subnet IDs (at least two availability zones) for the control plane ENIs and the node groups."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two availability zones."
  }
}

variable "endpoint_public_access" {
  description = "Expose the Kubernetes API on a public endpoint (restricted to public_access_cidrs). When false, the API is reachable only from inside the VPC."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDR blocks allowed to reach the public Kubernetes API endpoint when endpoint_public_access is true. Never 0.0.0.0/0 in production."
  type        = list(string)
  default     = []
}

variable "cpu_instance_types" {
  description = "EC2 instance types of the CPU node group (gateway, config service, NATS, CPU workers)."
  type        = list(string)
  default     = ["m6i.xlarge"]
}

variable "cpu_min_size" {
  description = "Minimum number of CPU nodes. Keep at least 1: the control services (gateway, config service, NATS) run there."
  type        = number
  default     = 1
}

variable "cpu_desired_size" {
  description = "Initial number of CPU nodes (later changes are left to the cluster autoscaler)."
  type        = number
  default     = 2
}

variable "cpu_max_size" {
  description = "Maximum number of CPU nodes."
  type        = number
  default     = 6
}

variable "gpu_instance_types" {
  description = "EC2 instance types of the GPU node group (one Heron worker per GPU)."
  type        = list(string)
  default     = ["g6.xlarge"]
}

variable "gpu_max_size" {
  description = "Maximum number of GPU nodes. The GPU node group's minimum is always 0: it scales to zero when no pool needs a GPU."
  type        = number
  default     = 4
}

variable "gpu_capacity_type" {
  description = "Capacity type of the GPU node group: ON_DEMAND or SPOT."
  type        = string
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "gpu_node_labels" {
  description = "Kubernetes labels on GPU nodes; GPU worker pods select them with a nodeSelector."
  type        = map(string)
  default = {
    "heron.dev/accelerator" = "nvidia"
  }
}

variable "node_disk_size_gb" {
  description = "Root volume size of every node in GiB (holds the images and the local weight cache, HERON_CACHE_DIR, unless a volume is mounted)."
  type        = number
  default     = 100
}

variable "bucket_name" {
  description = "Name of the S3 bucket for the weight cache and the config store. Globally unique; null derives \"<name>-heron-<account id>\"."
  type        = string
  default     = null
}

variable "cache_prefix" {
  description = "Key prefix of the weight cache in the bucket, without slashes (HERON_WEIGHTS_S3=s3://<bucket>/<cache_prefix>)."
  type        = string
  default     = "weights"
}

variable "config_prefix" {
  description = "Key prefix of the config store in the bucket, without slashes (heron config --store s3://<bucket>/<config_prefix>)."
  type        = string
  default     = "config"
}

variable "cache_noncurrent_days" {
  description = "Days after which overwritten or deleted weight-cache objects (noncurrent versions) are removed."
  type        = number
  default     = 7
}

variable "cache_expiration_days" {
  description = "Days after which weight-cache objects expire (they are refilled from the Hub on the next miss). 0 keeps them forever."
  type        = number
  default     = 0
}

variable "config_noncurrent_days" {
  description = "Days that old versions of config-store objects are kept (the config history to restore from)."
  type        = number
  default     = 90
}

variable "namespace" {
  description = "Kubernetes namespace Heron is deployed in."
  type        = string
  default     = "heron"
}

variable "worker_service_account" {
  description = "Name of the Kubernetes service account of the Heron workers; only it can assume the worker IAM role."
  type        = string
  default     = "heron-worker"
}

variable "config_service_account" {
  description = "Name of the Kubernetes service account of the Heron config service; only it can assume the config IAM role."
  type        = string
  default     = "heron-config"
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
