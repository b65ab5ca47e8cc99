"""Scorers (one per module; see extproc.scheduling.framework for the interface)."""
