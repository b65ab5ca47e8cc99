"""Passive outlier detection: eject an endpoint that answers generations with 5xx in a row.

Envoy's `ORIGINAL_DST` cluster has no outlier detection of its own, so the picker does it
(`healthy-filter` leaves ejected endpoints out), following Envoy's own rules
(envoy.config.cluster.v3.OutlierDetection):

* `consecutive_5xx` answers in a row with a 5xx status eject the endpoint;
* an ejection lasts `ejection_s × n` seconds, n the endpoint's ejections so far (Envoy's
  base_ejection_time × number of ejections), at most `max_ejection_s` (Envoy's
  max_ejection_time, 300 s); n starts again from 1 once the endpoint has answered for
  `max_ejection_s` without being ejected;
* no new ejection while `max_ejected_share` of the endpoints serving any of the endpoint's
  models are out already (Envoy's max_ejection_percent, per cluster there, per model pool here;
  50 % by default: 5xx storms across a pool are not one endpoint's fault);
* only an answer to a request routed after the latest ejection began speaks for the endpoint
  now: an older request finishing during (or after) the ejection neither resets nor extends
  the streak.
"""

from __future__ import annotations

import logging

from extproc.config.schema import OutlierDetectionConfig
from extproc.datastore.endpoints import Datastore, Endpoint

__all__ = ["OutlierDetector"]

log = logging.getLogger(__name__)


class OutlierDetector:
    """Counts generation answers per endpoint and ejects by the rules above.

    Args:
        store: the endpoints (the ejected share is taken over those sharing a model with the
            endpoint in question).
        cfg: thresholds and durations.
    """

    def __init__(self, store: Datastore, cfg: OutlierDetectionConfig) -> None:
        self._store = store
        self._cfg = cfg
        self.threshold = cfg.consecutive_5xx
        """5xx answers in a row that eject (count)."""

    def record(self, ep: Endpoint, status: int, routed_at: float, now: float) -> float | None:
        """Count one answer's HTTP status.

        Args:
            ep: the endpoint that answered.
            status: the answer's HTTP status.
            routed_at: when the request was routed there (`time.monotonic()` seconds).
            now: when the answer came (`time.monotonic()` seconds).

        Returns:
            the ejection's length (seconds) when this answer ejects the endpoint, else None.

        A 504 (Envoy's own timeout of a slow answer: not the engine failing) and a 429 (the
        engine shedding) leave the streak as it is; other non-5xx statuses end it. After an
        ejection, one more 5xx ejects again (the streak stays one short of the threshold).
        """
        cfg = self._cfg
        if status in (429, 504) or routed_at < ep.ejected_at:
            return None
        if status < 500:
            ep.consecutive_5xx = 0
            return None
        ep.consecutive_5xx += 1
        if ep.consecutive_5xx < cfg.consecutive_5xx or ep.ejected(now):
            return None
        # The share is taken within the endpoint's pool (the endpoints sharing a model with it):
        # a two-endpoint model in a fleet of ten must keep one, whatever the other models do.
        # Draining endpoints are leaving the pool: they count neither way.
        endpoints = list({id(o): o for m in ep.models for o in self._store.for_model(m)}.values())
        out = sum(1 for other in endpoints if other.ejected(now))
        if out >= cfg.max_ejected_share * len(endpoints):
            log.warning(
                "endpoint %s answered %d 5xx in a row but stays in: %d of %d endpoints are ejected already "
                "(max_ejected_share %.0f %%)",
                ep.address, ep.consecutive_5xx, out, len(endpoints), 100 * cfg.max_ejected_share,
            )  # fmt: skip
            return None
        if ep.ejections and now - ep.ejected_until >= cfg.max_ejection_s:
            ep.ejections = 0  # answered long enough since: start over at the base time
        ep.ejections += 1
        seconds = min(cfg.ejection_s * ep.ejections, cfg.max_ejection_s)
        ep.ejected_at = now
        ep.ejected_until = now + seconds
        ep.consecutive_5xx = cfg.consecutive_5xx - 1
        return seconds
