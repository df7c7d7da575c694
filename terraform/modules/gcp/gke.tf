locals {
  labels = merge({ "heron-cluster" = var.name }, var.labels)
}

# Nodes run as a minimal service account, not the Compute Engine default (Editor).
resource "google_service_account" "nodes" {
  project      = var.project_id
  account_id   = "${var.name}-nodes"
  display_name = "Heron ${var.name} GKE nodes"
}

resource "google_project_iam_member" "nodes" {
  for_each = toset([
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/artifactregistry.reader",
  ])
  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_container_cluster" "this" {
  #checkov:skip=CKV_GCP_66:Binary Authorization needs an attestor set-up the operator owns; enable it per organisation policy.
  #checkov:skip=CKV_GCP_24:PodSecurityPolicy was removed from Kubernetes in 1.25; Pod Security Admission replaces it.
  #checkov:skip=CKV_GCP_65:Google Groups for RBAC needs a Workspace domain the operator owns.
  provider = google

  project        = var.project_id
  name           = var.name
  location       = var.region
  node_locations = length(var.node_locations) > 0 ? var.node_locations : null

  network    = var.network
  subnetwork = var.subnetwork

  # Node pools are managed below; the default one is removed right after creation.
  remove_default_node_pool = true
  initial_node_count       = 1

  deletion_protection = true

  ip_allocation_policy {
    cluster_secondary_range_name  = var.pods_range_name
    services_secondary_range_name = var.services_range_name
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
    master_ipv4_cidr_block  = var.master_ipv4_cidr_block
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.master_authorized_networks
      content {
        display_name = cidr_blocks.key
        cidr_block   = cidr_blocks.value
      }
    }
  }

  release_channel {
    channel = var.release_channel
  }

  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  network_policy {
    enabled = true
  }

  addons_config {
    network_policy_config {
      disabled = false
    }
  }

  enable_intranode_visibility = true
  enable_shielded_nodes       = true
  enable_legacy_abac          = false

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  logging_service    = "logging.googleapis.com/kubernetes"
  monitoring_service = "monitoring.googleapis.com/kubernetes"

  resource_labels = local.labels

  # The default pool exists for a moment only; harden it anyway.
  node_config {
    service_account = google_service_account.nodes.email
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }

  lifecycle {
    ignore_changes = [node_config]
  }
}

# CPU nodes: gateway, config service, NATS and CPU workers.
resource "google_container_node_pool" "cpu" {
  project  = var.project_id
  name     = "cpu"
  cluster  = google_container_cluster.this.id
  location = var.region

  autoscaling {
    min_node_count = var.cpu_min_nodes
    max_node_count = var.cpu_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.cpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_size_gb    = var.node_disk_size_gb
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = merge(local.labels, { "heron.dev/accelerator" = "cpu" })

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }
}

# GPU nodes: scale to zero. Only pods that tolerate nvidia.com/gpu land here (the GPU worker
# pools); with no such pod pending, the cluster autoscaler removes every node.
resource "google_container_node_pool" "gpu" {
  project  = var.project_id
  name     = "gpu"
  cluster  = google_container_cluster.this.id
  location = var.region

  initial_node_count = 0

  autoscaling {
    min_node_count = 0
    max_node_count = var.gpu_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.gpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_size_gb    = var.node_disk_size_gb
    spot            = var.gpu_spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = merge(local.labels, var.gpu_node_labels)

    guest_accelerator {
      type  = var.gpu_accelerator_type
      count = var.gpu_accelerator_count
      gpu_driver_installation_config {
        gpu_driver_version = "DEFAULT" # GKE installs the NVIDIA driver
      }
    }

    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }

  lifecycle {
    ignore_changes = [initial_node_count]
  }
}
