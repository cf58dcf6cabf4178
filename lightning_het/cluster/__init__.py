"""Where the replicas run: rendezvous and process-group start-up, node topology, device plans, mixed accelerators."""
