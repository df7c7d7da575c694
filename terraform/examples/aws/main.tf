data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:Only the first three zones are used (slice below); a zone AWS adds later does not change the subnets.
  state = "available"
}

locals {
  azs = slice(data.aws_availability_zones.available.names, 0, 3)
}

# A VPC with private subnets for the nodes and one NAT gateway for their egress
# (image pulls, the Hugging Face Hub).
module "vpc" {
  #checkov:skip=CKV_TF_1:A Terraform Registry module pinned by version constraint; registry sources cannot take a commit hash.
  source  = "terraform-aws-modules/vpc/aws"
  version = "~> 5.0"

  name = var.name
  cidr = var.vpc_cidr
  azs  = local.azs

  private_subnets = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnets  = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 8, 48 + i)]

  enable_nat_gateway = true
  single_nat_gateway = true

  private_subnet_tags = { "kubernetes.io/role/internal-elb" = "1" }
  public_subnet_tags  = { "kubernetes.io/role/elb" = "1" }
}

module "heron" {
  source = "../../modules/aws"

  name                   = var.name
  subnet_ids             = module.vpc.private_subnets
  endpoint_public_access = length(var.public_access_cidrs) > 0
  public_access_cidrs    = var.public_access_cidrs
  gpu_instance_types     = var.gpu_instance_types
  gpu_max_size           = var.gpu_max_size
  namespace              = var.namespace
}
