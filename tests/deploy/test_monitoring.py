"""Alert rules, Prometheus and Alertmanager configs pass Prometheus' own checkers (Debian's
`prometheus` / `prometheus-alertmanager` packages; skipped where absent, `.ci/run` installs
them), the compose file passes `docker-compose config` (no daemon needed), and every metric the
rules and the Grafana dashboard query is one that our servers, agents or the engines export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, ROOT


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install prometheus prometheus-alertmanager docker-compose)")
    return path


def _run(*argv: str, cwd: Path | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_alert_rules_pass_promtool():
    out = _run(_tool("promtool"), "check", "rules", str(DEPLOY / "prometheus/alerts.yml"))
    assert "SUCCESS" in out


def test_compose_prometheus_config_passes_promtool(tmp_path: Path):
    cfg = yaml.safe_load((DEPLOY / "compose/prometheus.yml").read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]  # where docker-compose.yml mounts the rules
    shutil.copy(DEPLOY / "prometheus/alerts.yml", tmp_path / "alerts.yml")
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    _run(_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml"))


def test_alertmanager_config_passes_amtool():
    _run(_tool("amtool"), "check-config", str(DEPLOY / "prometheus/alertmanager.yml"))


def test_compose_file_passes_docker_compose_config():
    out = _run(_tool("docker-compose"), "config", cwd=DEPLOY / "compose")
    services = yaml.safe_load(out)["services"]
    assert {"envoy", "llm-extproc", "prometheus", "alertmanager", "grafana", "loadgen"} <= set(services)
    assert sum(1 for s in services if s.startswith("sim-")) == 3 and sum(1 for s in services if s.startswith("agent-")) == 3


def _exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana/llm-extproc.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return exprs


_PROMQL_WORDS = {
    "sum", "max", "min", "avg", "by", "rate", "histogram_quantile", "and", "or", "le", "up", "without",
    "rate_interval", "server_address", "instance", "endpoint", "phase", "outcome", "reason", "gpu", "job", "scorer", "decision",
}  # fmt: skip


def test_every_queried_metric_is_exported_somewhere():
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "extproc").rglob("*.py"))
    names = set()
    for expr in _exprs():
        expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # drop selectors, ranges, strings
        names |= {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if n not in _PROMQL_WORDS and not n.replace(".", "").isdigit()}
    missing = []
    for n in sorted(names):
        base = re.sub(r"_(bucket|count|sum|total)$", "", n)
        if f'"{base}"' not in source and f'"{n}"' not in source:
            missing.append(n)
    assert not missing, f"queried but exported nowhere in extproc/: {missing}"
    assert len(names) >= 20


def test_dashboard_covers_the_issue_list():
    dash = json.loads((DEPLOY / "grafana/llm-extproc.json").read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for needle in ("ttft", "inter-token", "weight", "score components", "reserved kv", "in-flight", "outcome and reason",
                   "decision latency by phase", "prefix-cache hit rate", "gpu memory", "gpu utilisation"):  # fmt: skip
        assert needle in titles, needle
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    prov = yaml.safe_load((DEPLOY / "compose/grafana/provisioning/dashboards/llm-extproc.yaml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose/docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../grafana/llm-extproc.json:{prov['providers'][0]['options']['path']}/llm-extproc.json:ro" in mounts
