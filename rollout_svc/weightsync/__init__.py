"""Weight sync, the parts both ends share: the sync order, announcement and barriers in Redis, and the tensor
transfer (which imports torch: `rollout_svc.weightsync.transfer`) (DESIGN.md section 5)."""
