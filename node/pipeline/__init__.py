"""SWARM pipelines: the pipeline node (stage servers and trainers), the trainer role and stage recovery."""
