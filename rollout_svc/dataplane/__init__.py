"""The data plane on Redis Streams: requests in, trajectories out, placement, the worker registry, the reaper and
dead letters (DESIGN.md section 3)."""
