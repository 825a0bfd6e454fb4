"""`rollout-svc chaos`: a Jepsen-style soak (`soak`), its fleet of supervised children (`fleet`) and its ledger
(`ledger`)."""
