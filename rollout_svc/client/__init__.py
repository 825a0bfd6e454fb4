"""What a trainer holds: `RolloutClient` (and its blocking twin), the producer's connection and its requests'
lifecycle, `WeightSender` (imports torch: import it from `rollout_svc.client.weight_sender`), and fleet status."""

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.sync_client import SyncRolloutClient

__all__ = ["RolloutClient", "SyncRolloutClient"]
