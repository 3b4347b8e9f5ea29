"""What every kind of node runs on: the shared node base, network, metrics, local training, workload and settings."""
