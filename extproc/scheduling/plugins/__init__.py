"""Scheduling plugins, one per module: `filters/`, `scorers/`, `pickers/`."""
