"""SWARM-style pipelines: stage servers, stochastic wiring, rebalancing and stage recovery (later issues)."""
