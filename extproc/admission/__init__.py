"""Admission control: who gets in when the fleet is full (KV fit, priority shedding)."""
