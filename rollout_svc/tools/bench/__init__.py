"""`rollout-svc bench`: every section of BENCHMARKS.md, each in its own module; `run.run_bench` runs them all."""
