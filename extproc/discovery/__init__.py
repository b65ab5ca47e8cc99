"""Endpoint discovery: where the datastore's endpoints come from, and how they come and go.

Each source (`static`, `dns`, `kubernetes`; `registry.SOURCES`) publishes the full set of
endpoints it currently sees; `manager.Discovery` merges the sets and applies the difference to
the datastore: a new ready endpoint is added, one that left (or is not ready, or terminating)
is drained — no new picks, its in-flight requests finish — and then removed through
`Datastore.remove_endpoint`, whose hooks drop its indexes and metric series.

A new source is one module here (a pydantic `Params` with a `type` literal and a
`DiscoverySource` subclass named `Source`) and one line in `registry.SOURCES`.
"""
