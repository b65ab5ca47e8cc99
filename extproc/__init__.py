"""llm-extproc: LLM-inference-aware load balancing for vLLM fleets behind Envoy.

Envoy keeps the transport; this package answers Envoy's external processing (ext_proc)
stream for each LLM request: parse → count tokens → estimate KV → admit → filter → score →
pick → mutate headers. See README.md and docs/ for the architecture.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
