"""SkyRL's server protocol on `serve`: the routes of vLLM's server and SkyRL's server actor, answered by the fleet as
one server whose world size is every GPU (weight-transfer rank) behind it.

Sources: SkyRL 0.3.0's `remote_inference_client.py` (the calls) and `vllm_server_actor.py` (the server it expects:
vLLM's, with its RL and dev routes), vLLM 0.32's `entrypoints/rl/online/api_router.py`, `serve/dev/sleep`,
`serve/dev/cache` and `scale_out/token_in_token_out` (the shapes). Point SkyRL's `RemoteInferenceClient` at
`serve` as both `proxy_url` and `server_urls=[that URL]`. The protocol's bodies, its token rendering and its weight
calls, without HTTP, are `rollout_svc.integrations.skyrl`; here are the routes, one module per role:

Data routes (`data_routes.data_router`, the data-plane keys): `POST /inference/v1/generate` (answered by the hot
lane, `rollout_svc.api.hot`), `/v1/chat/completions/render` (text only); `GET /get_world_size`, `/get_server_info`,
`/servers`, `/is_paused`, `/is_sleeping`.

Control routes (`control_routes.control_router`): `POST /pause?mode=keep|abort|wait&clear_cache=`, `/resume`,
`/sleep?level=&mode=`, `/wake_up?tags=`, `/reset_prefix_cache`, `/abort_requests`. Each is fleet-wide through the
control plane and answers once every live worker acknowledged it, in vLLM's shape. They need the admin token, as
`/admin/*` does; SkyRL's client sends none, so `serve --open-control` serves them without one, which `serve` allows
only on a loopback address. A pause is held as holder `http` (`/resume` releases that holder only: a pause held by
the trainer's `WeightSender` or an operator stays).

Weight routes (`weight_routes.weights_router`, behind the same rule as the control routes): `/fetch_weights`,
`/weight_info`, and vLLM's native weight transfer (`/init_weight_transfer_engine` ... `/collective_rpc`).

What one `serve` process keeps between SkyRL's calls (`records.py`): the generate requests in flight by the caller's
id (for `/abort_requests`), and the texts of recent completions (for the `/detokenize` SkyRL sends after each).
"""
