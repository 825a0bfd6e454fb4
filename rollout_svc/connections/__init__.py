"""Reaching Redis: connections from one URL (plain, TLS, unix socket, Sentinel), Redis Cluster topology, ACL users."""
