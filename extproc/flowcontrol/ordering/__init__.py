"""Orders inside one tenant's flow (one file each; `ORDERINGS` maps the config's names).

Each container holds `Ticket`s with lazy removal: `head()` drops dead tickets first."""

from __future__ import annotations

from extproc.flowcontrol.ordering.edf import EdfOrder
from extproc.flowcontrol.ordering.fcfs import FcfsOrder

__all__ = ["ORDERINGS", "EdfOrder", "FcfsOrder"]

ORDERINGS = {"fcfs": FcfsOrder, "edf": EdfOrder}
"""`flow_control.ordering` → container class."""
