"""Whole-model replicas: the DiLoCo/NoLoCo/SparseLoCo node, its averaging rounds and its joiner."""
