"""Offline batch rollouts: OpenAI Batch files run as RQ jobs through `RolloutClient`.

A batch is a JSONL file of OpenAI Batch lines (`{"custom_id", "method": "POST", "url", "body"}`, `url` one of
`/v1/chat/completions` and `/v1/completions`), kept in Redis with the batch's state (`BatchStore`). Submitting one
enqueues an RQ job (`run_batch`, JSON-serialized: RQ's `JSONSerializer`, never pickle) that `rollout-svc
batch-worker` runs: it feeds the lines through a `RolloutClient` with at most `batch_concurrency` in flight
and records each line's output (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`,
OpenAI's batch output format) as it completes; when all are done the output becomes a file (`output_file_id`) and,
if the batch was given a path, is written there too.

Nothing is lost when a batch worker dies (even `kill -9`), and no finished line is generated again:

- a line's requests carry the ids `batch:{id}:{custom_id}` (`:{j}` for the j-th of `n` choices) and their results
  go to the batch's own results stream (a named producer, `batch-{id}`), which outlives the run;
- a line's output is written once (`HSETNX` on custom_id, with the counters in the same script), so a run that
  resumes skips finished lines and a line answered twice is counted once;
- a line whose requests reached Redis is marked submitted: a resumed run awaits its results on that stream
  instead of sending it again (if none comes within the request timeout, it is sent again);
- the live run holds a lease (`batch_lease_ttl_s`) and refreshes it; a run that loses it exits at once. The batch
  worker requeues a running batch whose lease expired (the abandoned-job check, every second), and RQ's `Retry`
  runs a job again after it raised.
"""

from rollout_svc.batch.jobs import run_batch, submit_batch
from rollout_svc.batch.store import BatchStore

# `run_batch` is the job's function as RQ stores it in Redis ("rollout_svc.batch.run_batch"): jobs queued by an
# earlier release must find it here.
__all__ = ["BatchStore", "run_batch", "submit_batch"]
