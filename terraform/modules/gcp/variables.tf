variable "project_id" {
  description = "GCP project ID that holds the cluster and the bucket."
  type        = string
}

variable "name" {
  description = "Name of the GKE cluster; also the prefix of every other resource's name."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,20}$", var.name))
    error_message = "name must be 2-21 characters: lower-case letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "Region of the (regional) GKE cluster and of the bucket, e.g. \"us-central1\"."
  type        = string
}

variable "node_locations" {
  description = "Zones of the node pools; pick zones that offer gpu_accelerator_type. Empty uses every zone of the region."
  type        = list(string)
  default     = []
}

variable "network" {
  description = "Self link or name of the VPC network."
  type        = string
}

variable "subnetwork" {
  description = "Self link or name of the subnetwork for the nodes."
  type        = string
}

variable "pods_range_name" {
  description = "Name of the subnetwork's secondary range for pod IPs."
  type        = string
}

variable "services_range_name" {
  description = "Name of the subnetwork's secondary range for service IPs."
  type        = string
}

variable "master_ipv4_cidr_block" {
  description = "/28 range for the private control-plane endpoint."
  type        = string
  default     = "172.16.0.0/28"
}

variable "master_authorized_networks" {
  description = "CIDR blocks allowed to reach the Kubernetes API (map of display name => CIDR). Empty allows only the VPC."
  type        = map(string)
  default     = {}
}

variable "release_channel" {
  description = "GKE release channel: RAPID, REGULAR or STABLE."
  type        = string
  default     = "REGULAR"
}

variable "cpu_machine_type" {
  description = "Machine type of the CPU node pool (gateway, config service, NATS, CPU workers)."
  type        = string
  default     = "e2-standard-4"
}

variable "cpu_min_nodes" {
  description = "Minimum CPU nodes per zone. Keep at least 1: the control services run there."
  type        = number
  default     = 1
}

variable "cpu_max_nodes" {
  description = "Maximum CPU nodes per zone."
  type        = number
  default     = 3
}

variable "gpu_machine_type" {
  description = "Machine type of the GPU node pool; must accept gpu_accelerator_type."
  type        = string
  default     = "g2-standard-8"
}

variable "gpu_accelerator_type" {
  description = "GPU type attached to each GPU node, e.g. nvidia-l4, nvidia-tesla-t4, nvidia-h100-80gb."
  type        = string
  default     = "nvidia-l4"
}

variable "gpu_accelerator_count" {
  description = "GPUs per GPU node (Heron runs one worker per GPU)."
  type        = number
  default     = 1
}

variable "gpu_max_nodes" {
  description = "Maximum GPU nodes per zone. The GPU pool's minimum is always 0: it scales to zero when no pool needs a GPU."
  type        = number
  default     = 2
}

variable "gpu_spot" {
  description = "Use Spot VMs for the GPU node pool."
  type        = bool
  default     = false
}

variable "gpu_node_labels" {
  description = "Kubernetes labels on GPU nodes; GPU worker pods select them with a nodeSelector."
  type        = map(string)
  default = {
    "heron.dev/accelerator" = "nvidia"
  }
}

variable "node_disk_size_gb" {
  description = "Boot disk size of every node in GB (holds the images and the local weight cache unless a volume is mounted)."
  type        = number
  default     = 100
}

variable "bucket_name" {
  description = "Name of the GCS bucket for the weight cache and the config store. Globally unique; null derives \"<project_id>-<name>-heron\"."
  type        = string
  default     = null
}

variable "cache_prefix" {
  description = "Object prefix of the weight cache in the bucket, without slashes."
  type        = string
  default     = "weights"
}

variable "config_prefix" {
  description = "Object prefix of the config store in the bucket, without slashes."
  type        = string
  default     = "config"
}

variable "cache_noncurrent_days" {
  description = "Days after which overwritten or deleted weight-cache objects (noncurrent versions) are removed."
  type        = number
  default     = 7
}

variable "config_noncurrent_days" {
  description = "Days that old versions of config-store objects are kept."
  type        = number
  default     = 90
}

variable "namespace" {
  description = "Kubernetes namespace Heron is deployed in."
  type        = string
  default     = "heron"
}

variable "worker_service_account" {
  description = "Name of the Kubernetes service account of the Heron workers; only it (and config_service_account) can act as the Heron Google service account."
  type        = string
  default     = "heron-worker"
}

variable "config_service_account" {
  description = "Name of the Kubernetes service account of the Heron config service."
  type        = string
  default     = "heron-config"
}

variable "labels" {
  description = "Labels added to every resource that takes labels."
  type        = map(string)
  default     = {}
}

variable "create_hmac_key" {
  description = "Create an HMAC key for the Heron Google service account. Heron reaches buckets with boto3 through GCS's S3-compatible API, which takes HMAC keys, not Workload Identity tokens; the secret lands in the Terraform state."
  type        = bool
  default     = false
}
