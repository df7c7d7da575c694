variable "region" {
  description = "AWS region to deploy into."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Name of the EKS cluster and prefix of every resource."
  type        = string
  default     = "heron"
}

variable "vpc_cidr" {
  description = "CIDR block of the new VPC."
  type        = string
  default     = "10.40.0.0/16"
}

variable "public_access_cidrs" {
  description = "CIDR blocks (e.g. your office's) allowed to reach the Kubernetes API; empty keeps the API private to the VPC."
  type        = list(string)
  default     = []
}

variable "gpu_instance_types" {
  description = "EC2 instance types of the GPU node group."
  type        = list(string)
  default     = ["g6.xlarge"]
}

variable "gpu_max_size" {
  description = "Maximum number of GPU nodes (the minimum is 0)."
  type        = number
  default     = 4
}

variable "namespace" {
  description = "Kubernetes namespace Heron is deployed in."
  type        = string
  default     = "heron"
}
