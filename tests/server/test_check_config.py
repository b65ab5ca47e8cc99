"""`llm-extproc check-config`: a configuration checked as `serve` loads it, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from extproc.cli import app

VALID = """\
models:
  - name: Qwen/Qwen3-8B
endpoints:
  - {address: "10.0.0.1:8000", models: [Qwen/Qwen3-8B]}
  - {address: "10.0.0.2:8000", models: [Qwen/Qwen3-8B]}
scheduling: {profile: least-inflight}
"""


def _check(tmp_path: Path, text: str, env: dict[str, str] | None = None):
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path, CliRunner().invoke(app, ["check-config", "--config", str(path)], env=env or {})


def test_a_valid_config_is_one_ok_line(tmp_path: Path) -> None:
    path, result = _check(tmp_path, VALID)
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"OK: {path}: 1 model (Qwen/Qwen3-8B: tokenizer builtin:qwen3, architecture builtin:qwen3-8b); endpoints from static (2 endpoints); profile least-inflight (of 8); "
        "listens on 127.0.0.1:9002 (ext_proc), 127.0.0.1:9090 (admin)\n"
    )



def test_flow_control_says_the_envoy_timeout_it_needs(tmp_path: Path) -> None:
    # Without it, the shipped 2 s message_timeout answers 504 to every request queued over ~0.5 s.
    _, result = _check(tmp_path, VALID + "flow_control: {enabled: true, bands: {critical: {ttl_s: 90}}}\n")
    assert result.exit_code == 0, result.output
    assert "flow control (drr fairness, router gate; Envoy's ext_proc message_timeout must be >= 92 s)" in result.output


def test_every_problem_is_printed_and_the_exit_is_2(tmp_path: Path) -> None:
    """Both config problems, and the admin token file `serve` would also refuse."""
    bad = VALID.replace("profile: least-inflight", "profile: least-inflight, prefill_model: {attention_ratio: 0.2}")
    bad = bad.replace("10.0.0.2:8000", "vllm.local:8000")
    _, result = _check(tmp_path, bad, env={"LLM_EXTPROC_ADMIN_TOKEN_FILE": str(tmp_path / "absent")})
    assert result.exit_code == 2
    assert "endpoints[1].address" in result.output and "scheduling.prefill_model.attention_ratio: 0.2 is above" in result.output
    assert "LLM_EXTPROC_ADMIN_TOKEN_FILE: cannot read" in result.output
    assert not result.output.startswith("OK")


@pytest.mark.parametrize(
    "ratelimit",
    [
        '{enabled: true, backend: redis, redis: {url: "redis://app:hunter2@10.0.0.9:6379/0"}}',  # valid: the summary names it
        '{enabled: true, backend: redis, redis_url: "redis://app:hunter2@10.0.0.9:6379/0"}',  # an unknown key echoes its value
        '{enabled: true, backend: redis, redis: "redis://:hunter2@10.0.0.9:6379/0"}',  # a URL where a mapping goes
        '{tenants: {a: {api_key_sha256: "sk-hunter2"}}}',  # the key itself where its digests go
        # redis-py splits the user information at the last "@": a password may hold "@"
        '{enabled: true, backend: redis, redis: "redis://app:p@ss-hunter2@10.0.0.9:6379/0"}',
        # or "/" or a quote: no URL to redis-py, but still the password the user wrote
        '{enabled: true, backend: redis, redis: "redis://app:pa/hunter2@10.0.0.9:6379/0"}',
        """{enabled: true, backend: redis, redis: "redis://app:it's-hunter2@10.0.0.9:6379/0"}""",
        # redis-py's documented form for a socket's password, valid: the summary names it
        '{enabled: true, backend: redis, redis: {url: "unix:///run/redis.sock?db=0&password=hunter2"}}',
        '{enabled: true, backend: redis, redis: {url: "redis://10.0.0.9:6379/0?password=hunter2"}}',
        # credentials under keys the schema does not know, echoed as an unknown key's value
        '{redis: {passwd: hunter2}}',
        '{redis: {auth: hunter2}}',
        '{tenants: {a: {api_key: sk-hunter2}}}',
        '{tenants: {a: {apiKey: sk-hunter2}}}',
        '{redis: {pw: hunter2}}',
        '{redis: {accessKey: hunter2}}',
    ],
    ids=[
        "summary", "unknown-key", "not-a-mapping", "api-key", "at-in-password", "slash-in-password", "quote-in-password",
        "socket-query-password", "query-password", "passwd-key", "auth-key", "api_key-key", "apiKey-key", "pw-key",
        "accessKey-key",
    ],
)
def test_credentials_are_never_printed(tmp_path: Path, ratelimit: str) -> None:
    _, result = _check(tmp_path, VALID + f"ratelimit: {ratelimit}\n")
    assert "hunter2" not in result.output, result.output
    assert ("10.0.0.9:6379" in result.output) == ("10.0.0.9" in ratelimit)  # where it points is still said


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://10.0.0.9:99999/0", "Port out of range"),
        ("http://10.0.0.9:6379/0", "must specify one of the following schemes"),
        ("redis://10.0.0.9:6379/0?db=zero", "Invalid value for 'db'"),
        ("redis://app:pa/hunter2@10.0.0.9:6379/0", "percent-encode"),  # redis-py's message quoted "pa" as the port
    ],
)
def test_a_redis_url_the_client_refuses_is_refused_as_serve_would_fail(tmp_path: Path, url: str, reason: str) -> None:
    """`serve` builds its Redis client from the URL at start (rate limits, replica sync): one
    redis-py cannot parse stopped it with a traceback after check-config said OK."""
    from extproc.ratelimit.config import RedisConfig
    from extproc.ratelimit.redis_client import redis_client

    with pytest.raises(ValueError):  # what serve's start met
        redis_client(RedisConfig.model_construct(url=url, timeout_ms=50))
    _, result = _check(tmp_path, VALID + f'ratelimit: {{enabled: true, backend: redis, redis: {{url: "{url}"}}}}\n')
    assert result.exit_code == 2, result.output
    assert "ratelimit.redis.url: not a Redis URL redis-py accepts" in result.output and reason in result.output
    assert "hunter2" not in result.output and "'pa'" not in result.output


def test_redis_port_0_is_refused(tmp_path: Path) -> None:
    """redis-py parses port 0 and every connection then fails: refused like `load --url`'s."""
    _, result = _check(tmp_path, VALID + 'ratelimit: {redis: {url: "redis://10.0.0.9:0/0"}}\n')
    assert result.exit_code == 2 and "ratelimit.redis.url: port 0 is not a port" in result.output, result.output


@pytest.mark.parametrize("tokenizer", ["/nonexistent/tokenizer-dir", "builtin:nope"])
def test_a_tokenizer_serve_cannot_load_is_refused(tmp_path: Path, tokenizer: str) -> None:
    """`serve` loads every model's tokenizer before it listens and stops on one it cannot: the
    check said OK to both."""
    from extproc.config import load_config
    from extproc.pipeline.tokens import TokenizerLoadError
    from extproc.server.app import load_models

    text = VALID.replace("  - name: Qwen/Qwen3-8B\n", f'  - name: Qwen/Qwen3-8B\n    tokenizer: "{tokenizer}"\n')
    path, result = _check(tmp_path, text)
    with pytest.raises(TokenizerLoadError):  # what serve's start meets
        load_models(load_config(path, env={}))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and tokenizer.removeprefix("builtin:") in result.output


def test_a_decision_log_path_serve_cannot_open_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    """`serve` opens decision_log.path at start and stops on one it cannot open (a directory;
    a path below a file); check-config said OK. A good path is checked without creating it."""
    from extproc.config.schema import DecisionLogConfig
    from extproc.telemetry.decision_log import DecisionLog

    (tmp_path / "a-file").write_text("")
    for path, why in [(tmp_path, "Is a directory"), (tmp_path / "a-file" / "d.log", "Not a directory")]:
        with pytest.raises(OSError):  # what serve's start meets
            DecisionLog(DecisionLogConfig(path=str(path))).start()
        _, result = _check(tmp_path, VALID + f'decision_log: {{path: "{path}"}}\n')
        assert result.exit_code == 2, result.output
        assert f"error: cannot open decision_log.path {path}: {why}" in result.output
    fresh = tmp_path / "logs" / "decisions.jsonl"
    _, result = _check(tmp_path, VALID + f'decision_log: {{path: "{fresh}"}}\n')
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "logs").exists()


def test_an_overlay_is_checked_as_up_and_bench_lay_it(tmp_path: Path) -> None:
    """check-config could not check the YAML `up`/`demo`/`bench --extproc-config` lay over their
    generated config; `--overlay` checks it so, and says what the result configures."""
    path = tmp_path / "overlay.yaml"
    path.write_text("models: [{name: Qwen/Qwen3-8B, aliases: [fast], max_model_len: 8192}]\nscheduling: {profile: least-inflight}\n")
    result = CliRunner().invoke(app, ["check-config", "--overlay", str(path)], env={})
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"OK: {path} over the stack of the demo fleet: 1 model (Qwen/Qwen3-8B: tokenizer builtin:qwen3, ")
    assert "endpoints from static (4 endpoints); profile least-inflight" in result.output
    path.write_text("scheduling: {profile: nope}\n")
    result = CliRunner().invoke(app, ["check-config", "--overlay", str(path), "--fleet", "a100-qwen3-8b"], env={})
    assert result.exit_code == 2 and "profile 'nope' is not defined" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "give --config FILE"), (["--config", "a.yaml", "--overlay", "b.yaml"], "one of them"), (["--config", "a.yaml", "--fleet", "x"], "--fleet only applies with --overlay")],
    ids=["neither", "both", "fleet-without-overlay"],
)
def test_check_config_takes_a_config_or_an_overlay(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["check-config", *args], env={})
    assert result.exit_code == 2 and message in result.output


def test_an_overlay_on_a_named_fleet_is_checked_over_its_roles_and_adapters(tmp_path: Path) -> None:
    """`--fleet pd` was refused as an unknown profile (bench's CLI special-cased it beside the
    named fleets), and `--fleet lora` checked the overlay over a config without the adapters
    and GPU slots `up --fleet lora` generates."""
    from extproc.server.cli import _overlaid

    path = tmp_path / "overlay.yaml"
    path.write_text("scheduling: {profile: least-inflight}\n")
    result = CliRunner().invoke(app, ["check-config", "--overlay", str(path), "--fleet", "pd"], env={})
    assert result.exit_code == 0, result.output
    assert sorted(e.role for e in _overlaid(str(path), "pd").endpoints) == ["decode", "decode", "prefill", "prefill"]
    lora = _overlaid(str(path), "lora")
    assert len(lora.models[0].adapters) == 32 and lora.scheduling.lora_max_loras == 4
