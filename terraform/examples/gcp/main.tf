resource "google_compute_network" "this" {
  project                 = var.project_id
  name                    = var.name
  auto_create_subnetworks = false
}

resource "google_compute_subnetwork" "this" {
  #checkov:skip=CKV_GCP_26:VPC flow logs are an operator's cost/audit choice; enable log_config if required.
  project                  = var.project_id
  name                     = "${var.name}-nodes"
  region                   = var.region
  network                  = google_compute_network.this.id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = "pods"
    ip_cidr_range = var.pods_cidr
  }
  secondary_ip_range {
    range_name    = "services"
    ip_cidr_range = var.services_cidr
  }
}

# Node-to-node and pod-to-pod traffic inside the VPC; everything else inbound stays denied
# (GKE adds its own rules for the control plane).
resource "google_compute_firewall" "internal" {
  project       = var.project_id
  name          = "${var.name}-allow-internal"
  network       = google_compute_network.this.id
  direction     = "INGRESS"
  source_ranges = [var.subnet_cidr, var.pods_cidr]

  allow {
    protocol = "tcp"
  }
  allow {
    protocol = "udp"
  }
  allow {
    protocol = "icmp"
  }
}

# Private nodes reach the internet (image pulls, the Hugging Face Hub) through Cloud NAT.
resource "google_compute_router" "this" {
  project = var.project_id
  name    = var.name
  region  = var.region
  network = google_compute_network.this.id
}

resource "google_compute_router_nat" "this" {
  project                            = var.project_id
  name                               = var.name
  router                             = google_compute_router.this.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"
}

module "heron" {
  source = "../../modules/gcp"

  project_id                 = var.project_id
  name                       = var.name
  region                     = var.region
  node_locations             = var.node_locations
  network                    = google_compute_network.this.id
  subnetwork                 = google_compute_subnetwork.this.id
  pods_range_name            = "pods"
  services_range_name        = "services"
  master_authorized_networks = var.master_authorized_networks
  gpu_accelerator_type       = var.gpu_accelerator_type
  gpu_machine_type           = var.gpu_machine_type
  gpu_max_nodes              = var.gpu_max_nodes
  namespace                  = var.namespace
  create_hmac_key            = var.create_hmac_key
}
