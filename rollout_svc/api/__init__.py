"""The HTTP surface: a stateless FastAPI app in front of the queue."""

from rollout_svc.api.app import create_app

__all__ = ["create_app"]
