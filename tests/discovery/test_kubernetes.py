"""Kubernetes discovery against recorded-shape API server responses served locally (no API
server runs here): list, watch events, a dropped watch resumed from its resourceVersion, 410
Gone as an event and as a status (relist), the periodic full list, terminating / not-ready
endpoints drained while their requests finish, the token sent and never logged, the CA used."""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Callable
from pathlib import Path

import orjson
import pydantic
import pytest

from extproc.config.loader import ConfigError, config_from_mapping
from extproc.datastore.endpoints import Datastore
from extproc.discovery.base import Discovered, EndpointTemplate
from extproc.logthrottle import WarnEvery
from extproc.discovery.kubernetes import Malformed, Params, Source, pod_endpoint, pool_selector, slice_endpoints
from extproc.discovery.manager import Discovery
from tests.agent.agent_helpers import eventually
from tests.discovery.fake_apiserver import FakeApiServer, data, gone, hold, stream
from tests.e2e.certs import make_certs

TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-service-account-token"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
PODS = "/api/v1/namespaces/inference/pods"
POOL = "/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools/qwen3-8b"


def params(server: FakeApiServer, tmp_path: Path, *, scheme: str = "http", ca: Path | None = None, **kw) -> Params:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n", encoding="utf-8")
    base = {"namespace": "inference", "port": 8000, "models": ["m"], "labels": {"engine": "vllm"}}
    return Params(api_server=f"{scheme}://127.0.0.1:{server.port}", token_file=str(token), ca_file=str(ca or tmp_path / "no-ca.crt"), **{**base, **kw})


async def run_source(src: Source, server: FakeApiServer, cond: Callable[[], bool], done: asyncio.Event | None = None, timeout_s: float = 5.0) -> list[dict[str, Discovered]]:
    """Run `src` until `cond()`, then stop it, end the held watches (`done`) and the server;
    return what it published, in order."""
    reports: list[dict[str, Discovered]] = []
    task = asyncio.create_task(src.run(lambda r: reports.append(dict(r))))
    try:
        await eventually(cond, timeout_s=timeout_s)
    finally:
        if done is not None:
            done.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.aclose()
    return reports


def split(report: dict[str, Discovered]) -> tuple[set[str], set[str]]:
    """(ready addresses, listed-but-not-ready addresses)."""
    return {a for a, d in report.items() if d.ready}, {a for a, d in report.items() if not d.ready}


async def test_list_watch_drop_resume_and_410_relist_over_tls(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    certs = make_certs(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.server, certs.server_key)
    done = asyncio.Event()
    server = FakeApiServer(
        TOKEN,
        SLICES,
        lists=[data("endpointslices-list.json"), data("endpointslices-relist.json")],
        watches=[
            stream(data("endpointslices-watch-1.jsonl"), drop=True),  # events, then the connection drops
            stream(data("endpointslices-watch-2.jsonl")),  # resumed: a DELETED, then ERROR 410
            gone(),  # after the relist: refused with 410 at once -> relist again
            hold(done),
        ],
    )
    await server.start(ssl_context=ctx)
    src = Source(params(server, tmp_path, scheme="https", ca=certs.ca, selector="kubernetes.io/service-name=vllm-qwen3-8b"))
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 4, done)

    # The first list: ready, not ready, terminating (ready false), conditions left unset
    # (ready), an IPv6 slice; the FQDN slice is skipped.
    assert split(reports[0]) == (
        {"10.44.1.17:8000", "10.44.2.9:8000", "10.44.4.2:8000", "[fd00:10:44::5]:8000"},
        {"10.44.3.4:8000", "10.44.1.30:8000"},
    )
    assert reports[0]["10.44.1.17:8000"].config.labels == {"engine": "vllm"}
    # Watch events: 10.44.2.9 terminating, 10.44.3.4 ready, 10.44.1.30 gone; a new slice.
    assert split(reports[1]) == ({"10.44.1.17:8000", "10.44.3.4:8000", "10.44.4.2:8000", "[fd00:10:44::5]:8000"}, {"10.44.2.9:8000"})
    assert split(reports[2])[0] == split(reports[1])[0] | {"10.44.5.11:8000"}
    # Resumed after the drop from the bookmark's version, without listing again; then DELETED.
    watches = server.watch_requests()
    assert watches[0].query["resourceVersion"] == "48213" and watches[0].query["labelSelector"] == "kubernetes.io/service-name=vllm-qwen3-8b"
    assert watches[1].query["resourceVersion"] == "48250"
    assert server.seen.index(watches[1]) == server.seen.index(watches[0]) + 1  # no list in between
    assert "[fd00:10:44::5]:8000" not in reports[3]
    # The ERROR 410 event: relisted (the relist's set), watched from the new version, refused
    # with a 410 status: relisted again, watched again.
    assert split(reports[4]) == ({"10.44.1.17:8000", "10.44.3.4:8000", "10.44.5.11:8000", "10.44.6.3:8000"}, set())
    assert "resourceVersion" not in server.list_requests()[1].query
    assert watches[2].query["resourceVersion"] == "49002"
    assert len(server.list_requests()) == 3 and src.relists_for_gone == 2
    assert all(s.watch or s.query.get("labelSelector") for s in server.seen)
    # Every request carried the token; no log line shows it.
    assert all(s.authorized for s in server.seen)
    assert TOKEN not in caplog.text and "test-service-account-token" not in caplog.text


async def test_a_periodic_full_list_happens_while_the_watch_is_quiet(tmp_path: Path):
    done = asyncio.Event()
    server = FakeApiServer(TOKEN, SLICES, lists=[data("endpointslices-list.json")], watches=[hold(done)])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm", resync_s=1.0))
    await run_source(src, server, lambda: len(server.list_requests()) >= 3, done, timeout_s=10)
    assert all(int(w.query["timeoutSeconds"]) <= 1 for w in server.watch_requests())


async def test_an_unauthorized_answer_keeps_what_was_published_and_retries(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    server = FakeApiServer("another-token", SLICES, lists=[data("endpointslices-list.json")], watches=[gone()])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm"))
    reports = await run_source(src, server, lambda: len(server.seen) >= 2)
    assert reports == []
    assert "status 401" in caplog.text and TOKEN not in caplog.text


async def test_terminating_and_not_ready_endpoints_take_no_new_requests_but_finish_theirs(tmp_path: Path):
    gate, done = asyncio.Event(), asyncio.Event()
    server = FakeApiServer(
        TOKEN, SLICES, lists=[data("endpointslices-list.json")], watches=[stream(data("endpointslices-watch-1.jsonl"), gate=gate), hold(done)]
    )
    await server.start()
    store = Datastore([])
    d = Discovery(store, [Source(params(server, tmp_path, selector="app=vllm"))], initial_wait_s=5)
    try:
        await d.start()
        routable = {e.address for e in store.for_model("m")}
        assert routable == {"10.44.1.17:8000", "10.44.2.9:8000", "10.44.4.2:8000", "[fd00:10:44::5]:8000"}
        assert store.get("10.44.3.4:8000") is None and store.get("10.44.1.30:8000") is None  # never ready: never added
        held = store.reserve(store.get("10.44.2.9:8000"))
        gate.set()  # 10.44.2.9 starts terminating
        await eventually(lambda: store.get("10.44.5.11:8000") is not None)
        terminating = store.get("10.44.2.9:8000")
        assert terminating is not None and terminating.draining and terminating.inflight == 1
        assert "10.44.2.9:8000" not in {e.address for e in store.for_model("m")}
        assert "10.44.3.4:8000" in {e.address for e in store.for_model("m")}  # became ready
        held.release()
        assert store.get("10.44.2.9:8000") is None
    finally:
        done.set()
        await d.aclose()
        await server.aclose()


async def test_an_inference_pools_selector_and_port_pick_its_pods(tmp_path: Path):
    done = asyncio.Event()
    server = FakeApiServer(
        TOKEN, PODS, lists=[data("pods-list.json")], watches=[stream(data("pods-watch.jsonl")), hold(done)], objects={POOL: data("inferencepool.json")}
    )
    await server.start()
    src = Source(params(server, tmp_path, inference_pool="qwen3-8b", port=9999))
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 2, done)
    assert server.seen[0].path == POOL
    assert server.list_requests()[0].query["labelSelector"] == "app=vllm-qwen3-8b,inference.llm-extproc.dev/pool=qwen3-8b"
    # The pool's target port (8000), not the configured fallback (9999); the pending pod has no IP.
    assert split(reports[0]) == ({"10.44.1.17:8000", "10.44.2.9:8000"}, {"10.44.3.4:8000"})
    assert split(reports[1]) == ({"10.44.1.17:8000"}, {"10.44.2.9:8000", "10.44.3.4:8000"})  # deletionTimestamp set
    assert split(reports[2])[0] == {"10.44.1.17:8000", "10.44.4.2:8000"}
    assert "10.44.2.9:8000" not in reports[3]


def endpoint_slice(name: str, *ips: str, **fields) -> dict:
    """A minimal IPv4 EndpointSlice, every address ready; `fields` replace its top-level ones."""
    body = {"kind": "EndpointSlice", "metadata": {"name": name, "resourceVersion": "1"}, "addressType": "IPv4"}
    return {**body, "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips], **fields}


def slice_list(*items: object) -> bytes:
    return orjson.dumps({"kind": "EndpointSliceList", "metadata": {"resourceVersion": "100"}, "items": list(items)})


def events(*evs: object) -> bytes:
    return b"".join(orjson.dumps(e) + b"\n" for e in evs)


async def test_a_watch_cut_after_every_event_backs_off_instead_of_spinning(tmp_path: Path):
    # A proxy (or a broken server) that ends every watch right after one event: each resumed
    # watch ends at once too. The source must back off, not reconnect thousands of times a
    # second; the events still apply.
    one_event = events({"type": "MODIFIED", "object": endpoint_slice("s1", "10.0.0.2")})
    server = FakeApiServer(TOKEN, SLICES, lists=[slice_list(endpoint_slice("s1", "10.0.0.1"))], watches=[stream(one_event)])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm"), rng=random.Random(7))
    reports: list[dict[str, Discovered]] = []
    task = asyncio.create_task(src.run(lambda r: reports.append(dict(r))))
    try:
        await asyncio.sleep(2.0)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.aclose()
    # Backoff 0.1 s doubling, equal jitter: the delays before watches 2..7 add up to at least
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s = 1.55 s, so at most 7 watches fit in 2 s (without the backoff: over 1,500).
    assert 2 <= len(server.watch_requests()) <= 7
    assert len(server.list_requests()) == 1  # resumed each time, never relisted
    assert set(reports[-1]) == {"10.0.0.2:8000"}


async def test_malformed_objects_are_skipped_and_the_others_used(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    done = asyncio.Event()
    good = endpoint_slice("good", "10.0.0.1", "10.0.0.2")
    listed = slice_list(
        "not an object",
        endpoint_slice("name-a-list", "10.0.0.3", metadata={"name": ["x"]}),
        endpoint_slice("int-address", "10.0.0.4", endpoints=[{"addresses": [167772165]}]),
        good,
        endpoint_slice("conditions-a-list", "10.0.0.6", endpoints=[{"addresses": ["10.0.0.6"], "conditions": [True]}]),
    )
    watched = events(
        ["an", "event", "that", "is", "a", "list"],
        {"type": "ADDED", "object": "a string"},
        {"type": "ADDED", "object": endpoint_slice("endpoints-a-dict", endpoints={"addresses": ["10.0.0.7"]})},
        # The good slice, modified into a bad shape: ignored, its addresses stay as they were.
        {"type": "MODIFIED", "object": endpoint_slice("good", endpoints=[{"addresses": ["10.0.0.1"], "conditions": ["ready"]}])},
        {"type": "ADDED", "object": endpoint_slice("new", "10.0.0.8")},
    )
    server = FakeApiServer(TOKEN, SLICES, lists=[listed], watches=[stream(watched), hold(done)])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm"))
    # A second watch means run() lived through every bad object (a crash would end it).
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 2, done)
    assert set(reports[0]) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert set(reports[-1]) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.8:8000"}
    assert src.malformed == 8 and len(server.list_requests()) == 1
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and "the object is a string" in warnings[0].getMessage()  # rate-limited


def test_warn_every_logs_once_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture):
    now = [0.0]
    warn = WarnEvery(logging.getLogger("test.warn_every"), 60.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 59.0, 60.0, 61.0):
        now[0] = t
        warn.warning("bad object %d", int(t))
    assert [r.getMessage() for r in caplog.records] == ["bad object 0", "bad object 60 (2 similar lines suppressed)"]
    assert warn.suppressed == 1


@pytest.mark.parametrize(
    ("extract", "obj", "field"),
    [
        (slice_endpoints, endpoint_slice("s", endpoints={"addresses": ["10.0.0.1"]}), "endpoints is an object"),
        (slice_endpoints, endpoint_slice("s", endpoints=["10.0.0.1"]), "an endpoint is a string"),
        (slice_endpoints, endpoint_slice("s", endpoints=[{"addresses": [10]}]), "an address is a number"),
        (slice_endpoints, endpoint_slice("s", endpoints=[{"addresses": "10.0.0.1"}]), "addresses is a string"),
        (slice_endpoints, endpoint_slice("s", endpoints=[{"addresses": ["10.0.0.1"], "conditions": []}]), "conditions is a list"),
        (slice_endpoints, [], "the object is a list"),
        (pod_endpoint, {"status": []}, "status is a list"),
        (pod_endpoint, {"status": {"podIPs": ["10.0.0.1"]}}, "a podIPs entry is a string"),
        (pod_endpoint, {"status": {"podIP": 10}}, "podIP is a number"),
        (pod_endpoint, {"status": {"podIP": "10.0.0.1", "conditions": {"type": "Ready"}}}, "conditions is an object"),
        (pod_endpoint, {"status": {"podIP": "10.0.0.1"}, "metadata": "m"}, "metadata is a string"),
    ],
)
def test_a_malformed_object_raises_malformed_naming_the_field(extract, obj, field):
    with pytest.raises(Malformed, match=field):
        extract(obj)


@pytest.mark.parametrize("port", ["99999", 99999, 0, [8000], True, 8000.5, "8000"])
def test_a_pool_target_port_must_be_an_integer_port_number(port):
    with pytest.raises(ValueError, match=f"target port {port!r}".replace("[", r"\[").replace("]", r"\]")):
        pool_selector({"spec": {"selector": {"app": "vllm"}, "targetPorts": [{"number": port}]}})
    with pytest.raises(ValueError, match="target port"):
        pool_selector({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": port}})


async def test_a_pool_with_an_out_of_range_port_publishes_nothing_and_says_which_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # Was: "99999" accepted, then every pod skipped as "not an IP literal" (the fleet drained).
    pool = orjson.loads(data("inferencepool.json"))
    pool["spec"]["targetPorts"] = [{"number": "99999"}]
    server = FakeApiServer(TOKEN, PODS, lists=[data("pods-list.json")], watches=[gone()], objects={POOL: orjson.dumps(pool)})
    await server.start()
    src = Source(params(server, tmp_path, inference_pool="qwen3-8b"))
    reports = await run_source(src, server, lambda: len(server.seen) >= 2)
    assert reports == [] and {s.path for s in server.seen} == {POOL}  # the pods were never listed
    assert "target port '99999' is not an integer 1..65535" in caplog.text and "not an IP literal" not in caplog.text


def test_pool_selector_reads_v1_and_v1alpha2_shapes():
    assert pool_selector({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}}, "targetPorts": [{"number": 8000}]}}) == ("a=1,b=2", 8000)
    assert pool_selector({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8080}}) == ("app=vllm", 8080)
    with pytest.raises(ValueError):
        pool_selector({"spec": {"selector": {}}})


def test_exactly_one_of_selector_and_inference_pool():
    raw = {"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "kubernetes", "port": 8000, "models": ["m"]}]}}
    with pytest.raises(ConfigError, match="exactly one of selector"):
        config_from_mapping(raw)
    raw["discovery"]["sources"][0]["selector"] = "app=vllm"
    assert config_from_mapping(raw).discovery.sources[0].selector == "app=vllm"


def test_port_comes_from_the_pool_but_is_required_with_a_selector():
    # The InferencePool names its target port: the picker config in deploy/inferencepool gives
    # none (the schema used to require one anyway); a selector's EndpointSlices need ours.
    src = {"type": "kubernetes", "models": ["m"], "inference_pool": "vllm-qwen3-8b"}
    raw = {"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [src]}}
    assert config_from_mapping(raw).discovery.sources[0].port is None
    raw["discovery"]["sources"] = [{"type": "kubernetes", "models": ["m"], "selector": "app=vllm"}]
    with pytest.raises(ConfigError, match="port is required with selector"):
        config_from_mapping(raw)


SOCKETS = {"kv_events": "tcp://{host}:5557", "kv_events_replay": "tcp://{host}:5558", "agent": "{host}:9100"}


async def test_a_pools_pods_get_their_own_kv_event_sockets_and_agent(tmp_path: Path):
    done = asyncio.Event()
    server = FakeApiServer(TOKEN, PODS, lists=[data("pods-list.json")], watches=[hold(done)], objects={POOL: data("inferencepool.json")})
    await server.start()
    src = Source(params(server, tmp_path, inference_pool="qwen3-8b", **SOCKETS))
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 1, done)
    pod = reports[0]["10.44.1.17:8000"].config
    assert (pod.kv_events, pod.kv_events_replay, pod.agent) == ("tcp://10.44.1.17:5557", "tcp://10.44.1.17:5558", "10.44.1.17:9100")
    other = reports[0]["10.44.2.9:8000"].config
    assert other.kv_events == "tcp://10.44.2.9:5557" and other.agent == "10.44.2.9:9100"


async def test_ipv6_slice_endpoints_get_bracketed_sockets(tmp_path: Path):
    done = asyncio.Event()
    six = endpoint_slice("vllm-v6", "fd00:44::17", addressType="IPv6")
    server = FakeApiServer(TOKEN, SLICES, lists=[slice_list(six)], watches=[hold(done)])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm", kv_events="tcp://{host}:5557"))
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 1, done)
    assert reports[0]["[fd00:44::17]:8000"].config.kv_events == "tcp://[fd00:44::17]:5557"


@pytest.mark.parametrize(
    ("field", "template", "message"),
    [
        ("kv_events", "tcp://{pod_ip}:5557", r"kv_events: kv_events template 'tcp://\{pod_ip\}:5557' has the unknown placeholder \{pod_ip\}"),
        ("kv_events", "zmq://{host}:5557", "kv_events: .*must start with tcp://"),
        ("kv_events", "tcp://10.0.0.1:5557", r"kv_events: .*has no \{host\}"),
        ("kv_events_replay", "tcp://{host}:99999", "kv_events_replay: .*renders to 'tcp://192.0.2.1:99999', which is not valid"),
        ("agent", "http://{host}:9100", "agent: agent template .* without a scheme"),
        ("agent", "{host}:{host}", r"agent: .*which is not valid"),
    ],
)
def test_a_bad_socket_template_is_a_configuration_error_naming_the_field(field: str, template: str, message: str):
    extra = {"kv_events": "tcp://{host}:5557"} if field == "kv_events_replay" else {}
    src = {"type": "kubernetes", "models": ["m"], "selector": "app=vllm", "port": 8000, **extra, field: template}
    with pytest.raises(ConfigError, match=rf"sources\[0\]: kubernetes source: {message}"):
        config_from_mapping({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [src]}})


def test_replay_template_needs_kv_events():
    src = {"type": "dns", "name": "vllm.test", "models": ["m"], "port": 8000, "kv_events_replay": "tcp://{host}:5558"}
    with pytest.raises(ConfigError, match="kv_events_replay needs kv_events"):
        config_from_mapping({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [src]}})


def ready_pod(name: str, ip: str, annotations: dict[str, str] | None = None, version: str = "1") -> dict:
    """A ready Pod of the qwen3-8b pool, with `annotations`."""
    meta = {"name": name, "resourceVersion": version, "labels": {"app": "vllm-qwen3-8b"}, "annotations": annotations or {}}
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


async def test_a_pods_port_annotations_move_its_own_sockets_never_their_host(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    done = asyncio.Event()
    pods = [
        ready_pod("moved", "10.44.1.17", {"llm-extproc.io/kv-events-port": "6000", "llm-extproc.io/agent-port": "9200"}),
        ready_pod("bad", "10.44.2.9", {"llm-extproc.io/kv-events-port": "10.0.0.66:5557"}),  # a host is not a port
        ready_pod("plain", "10.44.3.4"),
    ]
    pod_list = orjson.dumps({"kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": pods})
    # A watch event changes the plain pod's replay port (the template has kv_events): re-published.
    change = events({"type": "MODIFIED", "object": ready_pod("plain", "10.44.3.4", {"llm-extproc.io/kv-events-replay-port": "7000"}, "11")})
    server = FakeApiServer(TOKEN, PODS, lists=[pod_list], watches=[stream(change), hold(done)], objects={POOL: data("inferencepool.json")})
    await server.start()
    src = Source(params(server, tmp_path, inference_pool="qwen3-8b", kv_events="tcp://{host}:5557", agent="{host}:9100"))
    with caplog.at_level(logging.WARNING):
        reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 2, done)
    moved, bad, plain = (reports[0][a].config for a in ("10.44.1.17:8000", "10.44.2.9:8000", "10.44.3.4:8000"))
    assert (moved.kv_events, moved.agent) == ("tcp://10.44.1.17:6000", "10.44.1.17:9200")
    assert (bad.kv_events, bad.agent) == ("tcp://10.44.2.9:5557", "10.44.2.9:9100")  # ignored, never 10.0.0.66
    assert "pod bad: ignoring llm-extproc.io/kv-events-port" in caplog.text and "10.0.0.66" not in caplog.text
    assert (plain.kv_events, plain.kv_events_replay) == ("tcp://10.44.3.4:5557", None)
    assert reports[1]["10.44.3.4:8000"].config.kv_events_replay == "tcp://10.44.3.4:7000"


def test_a_replay_port_annotation_without_kv_events_is_dropped():
    p = Params(namespace="x", inference_pool="pool", models=["m"], api_server="http://127.0.0.1:1")
    assert p.endpoint("10.0.0.1", 8000, socket_ports={"kv_events_replay": 7000}).kv_events_replay is None
    cfg = p.endpoint("fd00::1", 8000, socket_ports={"kv_events": 6000, "kv_events_replay": 7000})
    assert (cfg.kv_events, cfg.kv_events_replay) == ("tcp://[fd00::1]:6000", "tcp://[fd00::1]:7000")


@pytest.mark.parametrize(
    ("field", "template"),
    [
        ("kv_events", "tcp://{host}.evil.example:5557"),  # renders 10.1.2.3.evil.example: a DNS name
        ("agent", "{host}.evil.example:9100"),
        ("kv_events", "tcp://eth0;{host}:5557"),  # ZMQ "source;destination" syntax
        ("kv_events", "tcp://{host}{host}:5557"),
        ("agent", "{host}@evil:9100"),
        ("agent", "{host}:9100,evil:1"),
        ("agent", "ipv4:{host}:9100,169.254.169.254:80"),  # gRPC's multi-address target syntax
        ("agent", "unix:/run/{host}.sock:1"),  # gRPC dials a Unix socket
    ],
)
def test_socket_template_that_does_not_render_to_the_address_is_refused(field: str, template: str) -> None:
    """A discovered endpoint's socket templates must put the router on the discovered address
    itself (docs/discovery.md: "{host} becomes the address"), never on a name a DNS answer
    resolves, nor on a second host or a ZMQ source-interface spec."""
    with pytest.raises(pydantic.ValidationError):
        EndpointTemplate(port=8000, models=["m"], **{field: template})


async def test_the_llm_d_role_label_gives_the_endpoints_their_p_d_role(tmp_path: Path):
    # llm-d labels its prefill and decode Pods `llm-d.ai/role`; an EndpointSlice carrying the
    # label gives its addresses that role, a slice without it leaves them `both`, and a value
    # that is not a role skips the slice's addresses instead of routing them as something else.
    def labelled(name: str, ip: str, role: str) -> dict:
        return endpoint_slice(name, ip, metadata={"name": name, "resourceVersion": "1", "labels": {"llm-d.ai/role": role}})

    done = asyncio.Event()
    listed = slice_list(labelled("p", "10.0.0.1", "prefill"), labelled("d", "10.0.0.2", "decode"), endpoint_slice("u", "10.0.0.3"), labelled("x", "10.0.0.4", "decoder"))
    server = FakeApiServer(TOKEN, SLICES, lists=[listed], watches=[hold(done)])
    await server.start()
    src = Source(params(server, tmp_path, selector="app=vllm"))
    reports = await run_source(src, server, lambda: len(server.watch_requests()) >= 1, done)
    roles = {a: d.config.role for a, d in reports[0].items()}
    assert roles == {"10.0.0.1:8000": "prefill", "10.0.0.2:8000": "decode", "10.0.0.3:8000": "both"}
    store = Datastore([d.config for d in reports[0].values()])
    assert store.get("10.0.0.1:8000").role == "prefill" and store.get("10.0.0.3:8000").role == "both"
