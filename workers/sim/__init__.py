"""The simulated GPU engine (`--engine sim`): vLLM v1's scheduling over a cost model of one step, for fleet-scale
scheduling studies on machines without GPUs. Never the default; never a feature's proof (docs/simulator.md)."""
