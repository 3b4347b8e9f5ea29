"""Whole-replica averaging: round rendezvous over the DHT, payload exchange, outer optimizers, state download."""
