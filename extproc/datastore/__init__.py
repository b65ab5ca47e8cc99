"""Endpoint state: configuration, health, in-flight accounting (and later scraped engine metrics)."""
