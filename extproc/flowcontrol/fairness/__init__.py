"""Fairness between the tenants of one priority band (one file each; `FAIRNESS` maps the
config's names to classes).

A policy answers two calls on a band that holds at least one ticket:

* `pick(band) -> Flow`: whose head goes next (may update the policy's own credit, never the
  queues);
* `dispatched(band, flow, ticket)`: that head was dispatched (charge it, rotate). A pick whose
  request could not be dispatched (the gate closed) is not charged.

`forget(flow)` is called when a flow empties (it leaves the band's ring).
"""

from __future__ import annotations

from extproc.flowcontrol.fairness.drr import DeficitRoundRobin
from extproc.flowcontrol.fairness.fcfs import GlobalFcfs
from extproc.flowcontrol.fairness.round_robin import RoundRobin

__all__ = ["FAIRNESS", "DeficitRoundRobin", "GlobalFcfs", "RoundRobin"]

FAIRNESS = {"fcfs": GlobalFcfs, "round-robin": RoundRobin, "drr": DeficitRoundRobin}
"""`flow_control.fairness` → policy class (constructed with the `flow_control` config)."""
