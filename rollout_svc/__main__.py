"""`python -m rollout_svc`: the same as the `rollout-svc` command."""

from rollout_svc.cli import main

main()
