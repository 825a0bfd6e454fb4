"""Deployment: a local cluster of processes, a local Redis Cluster, Ray worker groups, child-process helpers.
The runtime never imports it."""
