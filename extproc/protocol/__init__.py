"""Wire formats: OpenAI request models and (later) the incremental SSE parser."""
