"""The simulator's side of P/D disaggregation: vLLM's NIXL connector protocol, simulated.

* **Prefill side**: a request whose `kv_transfer_params.do_remote_decode` is true runs as usual
  (the sidecar sends it with `max_tokens=1`); when it finishes, its blocks are *held*
  (`Engine.kv_holds`) and the response carries the `kv_transfer_params` the decode side needs
  (`prefill_params`). The hold ends when a decode engine pulls the blocks (`POST /sim/kv/pull`)
  or after `kv_hold_timeout_s` (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s by default),
  counted as `vllm:nixl_num_kv_expired_reqs`.
* **Decode side**: a request whose `kv_transfer_params.do_remote_prefill` is true pulls the
  blocks from `remote_host:remote_port` (here the prefill simulator's HTTP port; NIXL's side
  channel in vLLM), waits the transfer time `prompt tokens × KV bytes per token ÷ link
  bandwidth`, then runs with its prompt already computed. A pull that finds no blocks fails the
  request (vLLM's `kv_load_failure_policy=fail`) with a 500, counted as
  `vllm:nixl_num_failed_transfers`; it never recomputes the prompt silently.

Metric names are vLLM's NIXL connector's (`NixlPromMetrics`: `vllm:nixl_xfer_time_seconds`,
`vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers`, `vllm:nixl_num_kv_expired_reqs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from extproc.sim.stats import Histogram

__all__ = ["NixlStats", "TransferRequest", "parse_kv_transfer", "prefill_params", "XFER_TIME_BUCKETS", "BYTES_BUCKETS"]

XFER_TIME_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
"""`vllm:nixl_xfer_time_seconds` buckets (vLLM's, seconds)."""
BYTES_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(20, 34, 2))
"""`vllm:nixl_bytes_transferred` buckets (bytes, 1 MiB .. 8 GiB by ×4)."""


@dataclass
class NixlStats:
    """NIXL connector counters of one simulated engine (simulated seconds, bytes, counts)."""

    xfer_time: Histogram = field(default_factory=lambda: Histogram(XFER_TIME_BUCKETS))
    bytes_transferred: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    failed_transfers: int = 0


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """What a request's `kv_transfer_params` asks of this engine.

    Attributes:
        role: `prefill` (hold the blocks for a remote decode) or `decode` (pull them).
        remote_host / remote_port: the prefill engine to pull from (decode only).
        remote_request_id: the prefill side's id of the held blocks (decode only).
    """

    role: str
    remote_host: str = ""
    remote_port: int = 0
    remote_request_id: str = ""


def parse_kv_transfer(body: Any) -> TransferRequest | None:
    """The P/D part of a request body (a parsed JSON object), or None when it has no
    `kv_transfer_params` or asks for neither side.

    Raises:
        ValueError: `kv_transfer_params` is not an object, or a decode request lacks the
            remote host, port or request id (the message names the field).
    """
    if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
        return None
    kv = body["kv_transfer_params"]
    if not isinstance(kv, dict):
        raise ValueError("kv_transfer_params: must be an object")
    if kv.get("do_remote_decode") is True:
        return TransferRequest("prefill")
    if kv.get("do_remote_prefill") is not True:
        return None
    host, port, rid = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_request_id")
    if not isinstance(host, str) or not host:
        raise ValueError("kv_transfer_params.remote_host: required for do_remote_prefill")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError("kv_transfer_params.remote_port: required for do_remote_prefill, a port 1..65535")
    if not isinstance(rid, str) or not rid:
        raise ValueError("kv_transfer_params.remote_request_id: required for do_remote_prefill")
    return TransferRequest("decode", host, port, rid)


def prefill_params(request_id: str, block_ids: list[int], engine_id: str, host: str, port: int) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill engine returns (vLLM's NIXL connector's shape): the
    decode side sends them back with its request to pull `block_ids` from `host:port`."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "tp_size": 1,
    }
