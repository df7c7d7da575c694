data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  partition = data.aws_partition.current.partition
  tags      = merge({ "heron.dev/cluster" = var.name }, var.tags)
}

# One customer-managed key encrypts the cluster's Kubernetes secrets and the bucket.
resource "aws_kms_key" "this" {
  description             = "Heron ${var.name}: EKS secrets and the weight/config bucket"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}-heron"
  target_key_id = aws_kms_key.this.key_id
}

data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_111:This is the key policy (AWS's default one): "*" is this key only, and IAM policies grant its use.
  #checkov:skip=CKV_AWS_356:This is the key policy (AWS's default one): "*" is this key only.
  #checkov:skip=CKV_AWS_109:This is the key policy (AWS's default one): only the account itself administers the key.
  # The account administers the key (the AWS default key policy); IAM policies grant use.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"] # in a key policy, "*" means this key
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }

  # CloudWatch Logs encrypts the control-plane log group with this key.
  statement {
    sid = "CloudWatchLogsUse"
    actions = [
      "kms:Encrypt*",
      "kms:Decrypt*",
      "kms:ReEncrypt*",
      "kms:GenerateDataKey*",
      "kms:Describe*",
    ]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:/aws/eks/${var.name}/cluster"]
    }
  }
}

# --- control plane ------------------------------------------------------------------------

data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.name}-eks-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

# Envelope encryption of Kubernetes secrets with the module's key.
data "aws_iam_policy_document" "cluster_kms" {
  statement {
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "cluster_kms" {
  name   = "secrets-encryption"
  role   = aws_iam_role.cluster.id
  policy = data.aws_iam_policy_document.cluster_kms.json
}

resource "aws_cloudwatch_log_group" "cluster" {
  # EKS writes control-plane logs to exactly this name.
  name              = "/aws/eks/${var.name}/cluster"
  retention_in_days = 365
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

resource "aws_eks_cluster" "this" {
  #checkov:skip=CKV_AWS_39:The public endpoint is off by default (endpoint_public_access = false); an operator who turns it on must list public_access_cidrs, and 0.0.0.0/0 is refused by a precondition.
  name     = var.name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  access_config {
    authentication_mode                         = "API_AND_CONFIG_MAP"
    bootstrap_cluster_creator_admin_permissions = true
  }

  vpc_config {
    subnet_ids              = var.subnet_ids
    endpoint_private_access = true
    endpoint_public_access  = var.endpoint_public_access
    public_access_cidrs     = var.endpoint_public_access ? var.public_access_cidrs : null
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = aws_kms_key.this.arn
    }
  }

  tags = local.tags

  depends_on = [
    aws_iam_role_policy_attachment.cluster,
    aws_iam_role_policy.cluster_kms,
    aws_cloudwatch_log_group.cluster,
  ]

  lifecycle {
    precondition {
      condition     = !var.endpoint_public_access || (length(var.public_access_cidrs) > 0 && !contains(var.public_access_cidrs, "0.0.0.0/0"))
      error_message = "endpoint_public_access needs public_access_cidrs: a non-empty list without 0.0.0.0/0."
    }
  }
}

# --- node groups --------------------------------------------------------------------------

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.name}-eks-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

# CPU nodes: gateway, config service, NATS and CPU workers.
resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = var.cpu_instance_types
  disk_size       = var.node_disk_size_gb

  scaling_config {
    min_size     = var.cpu_min_size
    desired_size = var.cpu_desired_size
    max_size     = var.cpu_max_size
  }

  labels = {
    "heron.dev/accelerator" = "cpu"
  }

  update_config {
    max_unavailable = 1
  }

  tags = local.tags

  lifecycle {
    # The cluster autoscaler owns the node count once the group exists.
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# GPU nodes: scale to zero. Only pods that tolerate nvidia.com/gpu land here (the GPU worker
# pools); with no such pod pending, the cluster autoscaler removes every node.
resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA" # NVIDIA driver and container toolkit included
  instance_types  = var.gpu_instance_types
  capacity_type   = var.gpu_capacity_type
  disk_size       = var.node_disk_size_gb

  scaling_config {
    min_size     = 0
    desired_size = 0
    max_size     = var.gpu_max_size
  }

  labels = var.gpu_node_labels

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  update_config {
    max_unavailable = 1
  }

  tags = local.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# Scale-from-zero: with no GPU node to look at, the cluster autoscaler learns the labels,
# taint and GPU count of a future node from tags on the node group's Auto Scaling group
# (EKS does not copy node group tags there, hence aws_autoscaling_group_tag).
locals {
  gpu_asg_tags = merge({
    "k8s.io/cluster-autoscaler/enabled"                                = "true"
    "k8s.io/cluster-autoscaler/${var.name}"                            = "owned"
    "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"     = "true:NoSchedule"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu" = "1"
    }, {
    for k, v in var.gpu_node_labels : "k8s.io/cluster-autoscaler/node-template/label/${k}" => v
  })
}

resource "aws_autoscaling_group_tag" "gpu" {
  for_each = local.gpu_asg_tags

  autoscaling_group_name = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name

  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}
