"""Prefill/decode disaggregation outside the router: the decode-side sidecar (`sidecar`)."""
