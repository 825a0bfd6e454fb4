"""OpenAI's shapes without FastAPI: request bodies, the rollout requests a body plans, responses and stream chunks,
errors; shared by the HTTP API and batch jobs."""
