"""Flow control: hold, order and shed generation requests at the gateway while the fleet is
saturated, instead of refusing them or piling them onto engines (issue 27, docs/decisions/0310).

Modules: `config` (the `flow_control:` section), `queues` (tickets, flows, bands, pools),
`ordering/` (inside a flow: fcfs, edf), `fairness/` (inside a band: fcfs, round-robin, drr),
`gate` (may the chosen endpoint take it now?), `identity` (tenant, band, deadline of a
request), `controller` (enqueue, dispatch cycle, expiry, shutdown), `metrics`.
"""
