"""Operators' tools: the local swarm launcher, progress table, chaos, status, probe, doctor and evaluation."""
