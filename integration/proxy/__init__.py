"""The prefill/decode proxy: one OpenAI endpoint in front of pools of vLLM prefill and decode servers.

Per request (pull mode, the flow of vLLM's toy proxy and NixlConnector):
  1. prefill leg: the client's body with max_tokens=1, stream=false and
     kv_transfer_params={"do_remote_decode": true, ...} goes to the least-loaded healthy prefill
     instance; a connection error or 5xx is retried on another prefill instance;
  2. the prefill response's `kv_transfer_params` (where the KV is and how to get it) is put on the
     client's original body, which goes to the least-loaded healthy decode instance;
  3. the decode response (JSON or SSE stream) goes back to the client.
Push mode (`--mode push`, or header `X-KV-Transfer-Mode: push`) picks the decode instance first and
tells the prefill instance where to push: `transfer_mode: "push", push_target: "<decode KV store>"`.

Every wait is bounded (per-leg timeouts; a client's request head, body and idle keep-alive too), every
failure reaches the client as OpenAI-style error JSON (`{"error": {"message", "type", "code"}}`, code =
HTTP status; a body that is not JSON, deep nesting included, is a 400, one too large a 413, one beyond
the in-flight body budget a 503, a stalled one a 408, a client over its requests in flight a 429), a
client that goes away closes both upstream requests (vLLM then aborts them), and a health loop takes
dead instances out and puts recovered ones back. Prometheus metrics at /metrics (on the main port, or
on --metrics-port; behind a bearer token with --metrics-token-file).

Modules: `config` (ProxyConfig, the instance specs and their flags, the rule on forwarded
transfer-plane keys), `pool` (instances, least-loaded picking, the health loop), `metrics`, `errors`
(the error bodies and `upstream_failure`, the one mapping of an instance's status and body to the
proxy's outcome), `limits` (request bodies read as they arrive against --max-body-bytes, the
--max-inflight-body-bytes budget and --body-timeout: 413 / 503 / 408), `jsonbody` (a body decoded
only at its top level, its values passed on raw; --max-body-strings), `clients` (per-client
connection and request caps, the header timeout), `app` (PDProxy: routes and the P/D flow), `cli`
(`kvconnectors proxy`, `python -m kvconnectors.integration.proxy`).

Run: `kvconnectors proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200` or
`python -m kvconnectors.integration.proxy ...`.
"""

from .app import FORWARDED_HEADERS, PREFILL_KV_PARAMS, REQUEST_ID_HEADER, PDProxy, prefill_kv_params
from .cli import main, run, serve
from .config import (MODE_HEADER, MODES, TRANSFER_PLANE_KEYS, InstanceSpec, Mode, ProxyConfig, add_arguments,
                     check_forwarded_keys, config_argv, config_from_args, parse_decode, parse_hostport, parse_key_list,
                     parse_prefill, parse_url)
from .errors import ClientGone, PassThrough, ProxyError, error_body, kv_failure_cause, upstream_failure
from .metrics import ProxyMetrics
from .pool import HealthChecker, Instance, Pool

__all__ = [
    "FORWARDED_HEADERS", "MODE_HEADER", "MODES", "PREFILL_KV_PARAMS", "REQUEST_ID_HEADER", "TRANSFER_PLANE_KEYS",
    "ClientGone", "HealthChecker", "Instance", "InstanceSpec", "Mode", "PDProxy", "PassThrough", "Pool",
    "ProxyConfig", "ProxyError", "ProxyMetrics",
    "add_arguments", "check_forwarded_keys", "config_argv", "config_from_args", "error_body", "kv_failure_cause",
    "main",
    "parse_decode", "parse_hostport", "parse_key_list", "parse_prefill", "parse_url", "prefill_kv_params", "run",
    "serve",
    "upstream_failure",
]
