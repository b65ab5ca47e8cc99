"""Choosing an endpoint: filters drop endpoints, scorers rank them, a picker chooses."""
