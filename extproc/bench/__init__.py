"""Workloads, trace readers, load generation and policy comparison (`demo`, `up`, `bench`, `analyze`)."""
