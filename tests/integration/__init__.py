"""Integration tests: real processes, real p2pd daemons, loopback and network namespaces."""
