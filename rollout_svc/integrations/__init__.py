"""Adapters for the RL frameworks that drive a fleet: each imports its framework only when used."""
