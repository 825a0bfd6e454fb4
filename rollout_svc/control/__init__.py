"""The control plane: desired state in a Redis hash, epoch-numbered commands, pub/sub nudges, acknowledged barriers
(DESIGN.md section 4)."""
