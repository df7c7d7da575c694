variable "project_id" {
  description = "GCP project ID to deploy into."
  type        = string
}

variable "region" {
  description = "Region of the cluster, the network and the bucket."
  type        = string
  default     = "us-central1"
}

variable "name" {
  description = "Name of the GKE cluster and prefix of every resource."
  type        = string
  default     = "heron"
}

variable "node_locations" {
  description = "Zones of the node pools; they must offer gpu_accelerator_type."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-b"]
}

variable "subnet_cidr" {
  description = "Primary CIDR of the node subnetwork."
  type        = string
  default     = "10.50.0.0/20"
}

variable "pods_cidr" {
  description = "Secondary CIDR for pod IPs."
  type        = string
  default     = "10.60.0.0/14"
}

variable "services_cidr" {
  description = "Secondary CIDR for service IPs."
  type        = string
  default     = "10.64.0.0/20"
}

variable "master_authorized_networks" {
  description = "CIDR blocks allowed to reach the Kubernetes API (display name => CIDR), e.g. { office = \"203.0.113.0/24\" }."
  type        = map(string)
  default     = {}
}

variable "gpu_accelerator_type" {
  description = "GPU type of the GPU node pool."
  type        = string
  default     = "nvidia-l4"
}

variable "gpu_machine_type" {
  description = "Machine type of the GPU node pool; must accept gpu_accelerator_type."
  type        = string
  default     = "g2-standard-8"
}

variable "gpu_max_nodes" {
  description = "Maximum GPU nodes per zone (the minimum is 0)."
  type        = number
  default     = 2
}

variable "namespace" {
  description = "Kubernetes namespace Heron is deployed in."
  type        = string
  default     = "heron"
}

variable "create_hmac_key" {
  description = "Create an HMAC key so Heron's boto3 can reach the bucket through GCS's S3-compatible API (the secret lands in the Terraform state)."
  type        = bool
  default     = false
}
