"""An OpenAI-compatible vLLM simulator with a calibrated engine model (`llm-extproc sim`).

    profiles.py   GPU × model profiles: step-time coefficients, KV pool size, scheduler defaults
    blocks.py     KV block pool with chained block hashes and an LRU prefix cache
    engine.py     vLLM V1's scheduler stepped on a simulated clock (plan / commit)
    stats.py      counters and bulk histograms (plain data)
    metrics.py    vLLM's /metrics rendered from the engine at scrape time
    workload.py   output-length choice, synthetic prompts
    api.py        request parsing, response/SSE/error bodies in vLLM's shapes
    faults.py     fault injection model
    server.py     `SimServer` (aiohttp) — programmatic use: `await SimServer(port=0).start()`
    cli.py        the `sim` subcommand

Nothing heavy is imported here, so `llm-extproc --help` stays fast. See docs/simulator.md.
"""
