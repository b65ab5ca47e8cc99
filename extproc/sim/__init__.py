"""An OpenAI-compatible vLLM simulator with a calibrated engine model (`llm-extproc sim`)."""
