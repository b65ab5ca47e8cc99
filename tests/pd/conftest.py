"""The simulator fixtures (`start_sim`, `http`) for the P/D tests."""

from tests.sim.conftest import http, start_sim  # noqa: F401  (pytest fixtures)
