"""Configuration: the example loads, every error names its key and value, env overrides apply."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from extproc.config import ConfigError, default_config, load_config
from extproc.config.loader import config_from_mapping
from extproc.config.schema import BUILTIN_PROFILES, SAFE_FILTERS
from extproc.models import ARCHITECTURES_DIR

ROOT = Path(__file__).resolve().parents[2]


def minimal(**extra):
    raw = {"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}]}
    raw.update(extra)
    return raw


def problem_lines(raw):
    """The one-line problems a config that fails to load is reported with (after the header)."""
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    return [line.strip() for line in str(info.value).splitlines()[1:]]


def test_example_config_loads():
    cfg = load_config(ROOT / "deploy" / "config.example.yaml", env={})
    assert cfg.models[0].name == "Qwen/Qwen3-8B"
    assert [e.address for e in cfg.endpoints] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.limits.max_body_bytes == 4 * 1024 * 1024
    assert cfg.limits.max_json_values == default_config(["127.0.0.1:9000"], env={}).limits.max_json_values == 16384
    assert cfg.scheduling.outlier_detection == default_config(["127.0.0.1:9000"], env={}).scheduling.outlier_detection


def test_default_config_serves_the_default_model():
    cfg = default_config(["127.0.0.1:9000"], env={})
    assert cfg.models[0].name == "Qwen/Qwen3-8B" and cfg.models[0].tokenizer == "builtin:qwen3"
    assert cfg.endpoints[0].models == ["Qwen/Qwen3-8B"]


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        (minimal(listen={"grpc": "nope"}), ["listen.grpc", "'nope'"]),
        (minimal(models=[{"name": "m", "path": "builtin:qwen3-8b", "max_model_len": "big"}]), ["models[0].max_model_len", "'big'"]),
        (minimal(models=[{"name": "m", "path": "builtin:qwen3-8b", "toknizer": "x"}]), ["models[0].toknizer", "unknown key"]),
        (minimal(endpoints=[{"address": "vllm.local:8000", "models": ["m"]}]), ["endpoints[0].address", "vllm.local:8000"]),
        (minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["other"]}]), ["endpoints[0].models", "'other'"]),
        (minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["m"]}] * 2), ["listed twice"]),
        (minimal(models=[{"name": "m", "path": "builtin:qwen3-8b", "aliases": ["m"]}]), ["alias 'm'"]),
        (minimal(limits={"max_body_bytes": 9_000_000}), ["grpc_max_message_bytes", "max_body_bytes"]),
        (minimal(limits={"max_json_values": 10}), ["limits.max_json_values", "10"]),
        ({"endpoints": []}, ["models: required key is missing", "the smallest entry: `models: [{name: Qwen/Qwen3-8B}]`"]),
        (minimal(scheduling={"profile": "round-robin"}), ["scheduling", "'round-robin' is not defined"]),
        (minimal(scheduling={"profiles": {"p": {"scorers": [{"type": "kv-fit-filter"}]}}}), ["scheduling.profiles.p", "is not a scorer"]),
        (minimal(scheduling={"profiles": {"p": {"filters": [{"type": "nope-filter"}]}}}), ["unknown plugin type 'nope-filter'"]),
        (minimal(scheduling={"profiles": {"p": {"filters": [{"type": "kv-fit-filter", "params": {"headroom_fraction": 2}}]}}}), ["headroom_fraction"]),
        (minimal(admission={"priority": {"default": "vip"}}), ["admission.priority.default", "'vip'"]),
        (minimal(admission={"priority": {"shed_sheddable_at": 1.5, "shed_standard_at": 0.5}}), ["admission.priority", "shed_sheddable_at (1.5)"]),
        (minimal(scheduling={"prefill_model": {"prior_s_per_token_by_gpu": {"a100": 0}}}), ["prior_s_per_token_by_gpu", "> 0"]),
        (minimal(listen={"grpc": "0.0.0.0:5000", "admin": "127.0.0.1:5000"}), ["listen.grpc", "different ports"]),
        (minimal(scheduling={"prefill_model": {"attention_ratio": 2e-1}}),  # a typo of 2e-5
         ["scheduling.prefill_model.attention_ratio: 0.2 is above 0.001", "201,000 tokens of work", "2e-05"]),
        # Both passed check-config and serve silently (a new user's trial).
        ({**minimal(), "models": [{"name": "m", "path": "builtin:qwen3-8b", "architecture": "/nonexistent/config.json"}]},
         ["models[0]: architecture '/nonexistent/config.json'", "No such file"]),
        ({**minimal(), "models": [{"name": "m", "path": "builtin:qwen3-8b", "architecture": "builtin:nope"}]}, ["unknown built-in", "qwen3-8b"]),
        ({**minimal(), "models": [{"name": "m", "path": "builtin:qwen3-8b", "dtype": "fp9"}]}, ["dtype 'fp9'", "unknown dtype"]),
    ],
    ids=["bad-listen", "bad-int", "typo-key", "hostname-endpoint", "unknown-model-ref", "duplicate-endpoint", "alias-clash", "grpc-below-body", "json-values-too-low", "missing-models", "unknown-profile", "filter-as-scorer", "unknown-plugin", "bad-plugin-param", "bad-priority", "shedding-inverted", "bad-gpu-prefill-speed", "grpc-admin-one-port", "attention-ratio-typo",
         "missing-architecture", "unknown-builtin-architecture", "unknown-kv-dtype"],
)
def test_errors_name_the_key_and_value(raw, needles):
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    for needle in needles:
        assert needle in str(info.value)


def test_a_relative_architecture_path_is_looked_up_from_the_working_directory(tmp_path, monkeypatch):
    # The refusal names the absolute path it read, so a config checked from another directory
    # says where the file was looked for (it named only 'models/m').
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        config_from_mapping({**minimal(), "models": [{"name": "m", "path": "builtin:qwen3-8b", "architecture": "models/m"}]}, env={})
    assert f"No such file or directory: '{tmp_path / 'models' / 'm'}'" in str(info.value)
    (tmp_path / "models" / "m").mkdir(parents=True)
    shutil.copy(ARCHITECTURES_DIR / "qwen3-8b.json", tmp_path / "models" / "m" / "config.json")
    assert config_from_mapping({**minimal(), "models": [{"name": "m", "path": "builtin:qwen3-8b", "architecture": "models/m"}]}, env={}).models[0].architecture == "models/m"


def test_the_server_starts_each_endpoints_fit_at_its_gpus_prefill_speed():
    """`scheduling.prefill_model.prior_s_per_token_by_gpu` reaches the datastore: a labelled A100
    starts at its own speed, an unlabelled endpoint at the one prior; `{}` turns it off."""
    from extproc.server.app import ExtProcApp

    endpoints = [{"address": "10.0.0.1:8000", "models": ["m"], "labels": {"gpu": "A100"}}, {"address": "10.0.0.2:8000", "models": ["m"]}]
    a100, plain = ExtProcApp(config_from_mapping(minimal(endpoints=endpoints), env={})).store.all()
    assert (a100.prefill_fit.s_per_token, a100.prefill_fit.prior.known) == (6.73e-5, True)
    assert (plain.prefill_fit.s_per_token, plain.prefill_fit.prior.known) == (5e-5, False)
    off = config_from_mapping(minimal(endpoints=endpoints, scheduling={"prefill_model": {"prior_s_per_token_by_gpu": {}}}), env={})
    assert not any(ep.prefill_fit.prior.known for ep in ExtProcApp(off).store.all())


@pytest.mark.parametrize("value", [True, "6.7e-5"], ids=["bool", "numeric-string"])
def test_gpu_tables_take_numbers_only(value):
    """pydantic coerced `True` to 1.0 s per token and `"6.7e-5"` to a number in the GPU tables
    (the prefill prior's and the TTFT scorer's decode table): both are refused, an int is not."""
    prefill = minimal(scheduling={"prefill_model": {"prior_s_per_token_by_gpu": {"a100": value}}})
    with pytest.raises(ConfigError, match=rf"prior_s_per_token_by_gpu: prefill seconds per token for 'a100' must be a number > 0, got {value!r}"):
        config_from_mapping(prefill, env={})
    decode = minimal(scheduling={"profiles": {"p": {"scorers": [{"type": "ttft-estimate-scorer", "params": {"decode_s_per_context_token_by_gpu": {"a100": value}}}]}}})
    with pytest.raises(ConfigError, match=rf"decode seconds per context token for 'a100' must be a number >= 0, got {value!r}"):
        config_from_mapping(decode, env={})
    cfg = config_from_mapping(minimal(scheduling={"prefill_model": {"prior_s_per_token_by_gpu": {"a100": 1}}}), env={})
    assert cfg.scheduling.prefill_model.prior_s_per_token_by_gpu == {"a100": 1.0}


def test_env_overrides_addresses():
    cfg = config_from_mapping(minimal(), env={"LLM_EXTPROC_GRPC_ADDRESS": "127.0.0.1:7000", "LLM_EXTPROC_ADMIN_ADDRESS": "127.0.0.1:7001"})
    assert (cfg.listen.grpc, cfg.listen.admin) == ("127.0.0.1:7000", "127.0.0.1:7001")


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml", env={})


def test_a_control_character_is_one_line_naming_where(tmp_path) -> None:
    """PyYAML's reader error ran on to a second line and named no line or column."""
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - name: a\x00b\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == f"configuration {path} is not valid YAML at line 2, column 12: unacceptable character #x0000: special characters are not allowed"


@pytest.mark.parametrize(("text", "kind"), [("0", "int"), ("false", "bool"), ('""', "str"), ("[]", "list")])
def test_a_falsy_top_level_is_not_read_as_an_empty_mapping(tmp_path, text: str, kind: str) -> None:
    """Only an empty file is an empty configuration: a file holding `0` was told "models: required
    key is missing", as if it were a mapping without models."""
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=f"top level must be a mapping, got {kind}$"):
        load_config(path, env={})
    path.write_text("")
    with pytest.raises(ConfigError, match="models: required key is missing"):
        load_config(path, env={})


def test_a_file_nested_deeper_than_the_parser_goes_is_a_config_error(tmp_path) -> None:
    """PyYAML recurses once per level: 5,000 nested lists ended check-config and serve in a
    RecursionError traceback."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("models: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(deep, env={})


def test_a_profile_named_like_a_builtin_overrides_only_what_it_sets() -> None:
    """New weights for load-aware must not silently drop its filters (a dead endpoint would get traffic)."""
    cfg = config_from_mapping(minimal(scheduling={"profiles": {"load-aware": {"scorers": [{"type": "queue-depth-scorer", "weight": 3}]}}}))
    profile = cfg.scheduling.all_profiles()["load-aware"]
    assert [f.type for f in profile.filters] == [f.type for f in BUILTIN_PROFILES["load-aware"].filters]
    assert [(s.type, s.weight) for s in profile.scorers] == [("queue-depth-scorer", 3.0)]
    assert profile.picker.type == "max-score-picker"


@pytest.mark.parametrize(
    ("filters", "expected"),
    [(None, list(SAFE_FILTERS)), ([], []), ([{"type": "healthy-filter"}], ["healthy-filter"])],
    ids=["omitted-safe-set", "explicitly-none", "explicit"],
)
def test_new_profile_filters(filters, expected) -> None:
    spec = {"scorers": [{"type": "inflight-scorer"}]} | ({} if filters is None else {"filters": filters})
    cfg = config_from_mapping(minimal(scheduling={"profiles": {"mine": spec}}))
    assert [f.type for f in cfg.scheduling.all_profiles()["mine"].filters] == expected


@pytest.mark.parametrize(
    ("truncation", "needles"),
    [
        ({"mode": "middle"}, ["models[0].truncation.mode", "'middle'"]),
        ({"mode": "head-tail", "min_output_tokens": 40960}, ["min_output_tokens (40960) must be below max_model_len (40960)"]),
        ({"head": 5}, ["models[0].truncation.head: unknown key"]),
    ],
    ids=["unknown-mode", "no-room-left", "unknown-key"],
)
def test_truncation_errors_name_the_key(truncation, needles) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_mapping(minimal(models=[{"name": "m", "path": "builtin:qwen3-8b", "truncation": truncation}]))
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("yaml_value", "mode"),
    [("{mode: off}", "off"), ("off", "off"), ("head-tail", "head-tail"), ("{mode: on-request, head_tokens: 64}", "on-request")],
    ids=["bare-off", "mode-alone-off", "mode-alone", "mapping"],
)
def test_truncation_yaml_forms(tmp_path, yaml_value: str, mode: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models: [{{name: m, path: 'builtin:qwen3-8b', truncation: {yaml_value}}}]\nendpoints: [{{address: '10.0.0.1:8000', models: [m]}}]\n")
    assert load_config(path, env={}).models[0].truncation.mode == mode


def test_every_problem_is_reported_at_once_with_the_nearest_name():
    """An unknown key used to hide the checks that run after a section's fields are valid (an
    unknown profile, plugin type or model name): all of them come in one message now."""
    raw = minimal(
        scheduling={
            "profile": "load-awre",
            "metrics": {"intervl_s": 0.1},
            "profiles": {"mine": {"scorers": [{"type": "queue-depth-scorr"}, {"type": "queue-depth-scorer", "wieght": 2}]}},
        },
        endpoints=[{"address": "10.0.0.1:8000", "models": ["mm"], "lables": {}}],
    )
    problems = problem_lines(raw)
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "scheduling.metrics.intervl_s: unknown key; did you mean 'interval_s'?" in text
    assert "endpoints[0].lables: unknown key; did you mean 'labels'?" in text
    # Under a dict of named sections (profiles), the key is looked up in the section's fields.
    assert "scheduling.profiles.mine.scorers[1].wieght: unknown key; did you mean 'weight'?" in text
    assert "profile 'load-awre' is not defined; did you mean 'load-aware'?" in text
    assert "unknown plugin type 'queue-depth-scorr'; did you mean 'queue-depth-scorer'?" in text
    assert "'mm' is not a configured model name; did you mean 'm'?" in text


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        pytest.param(minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["mm"]}]), "endpoints[0].models", id="endpoint"),
        pytest.param(minimal(ratelimit={"enabled": True, "tenants": {"a": {"api_key_sha256": ["0" * 64], "models": {"mm": {"tokens_per_minute": 5}}}}}), "ratelimit.tenants.a.models", id="tenant"),
    ],
)
def test_an_unknown_model_reads_the_same_wherever_it_is_named(raw, where):
    """One message for a model name that is not configured, with its suggestion and the
    configured names, whether the schema or the late cross-checks find it."""
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    assert f"{where}: 'mm' is not a configured model name; did you mean 'm'? (configured: m)" in str(info.value)


def test_unknown_models_of_tenants_and_discovery_sources_come_with_the_other_problems():
    """A tenant's or a discovery source's unknown model was checked only once everything else
    was valid: beside a typo elsewhere it went unsaid until the next try."""
    raw = minimal(
        scheduling={"metrics": {"intervl_s": 0.1}},
        discovery={"sources": [{"type": "static"}, {"type": "dns", "name": "vllm.svc", "port": 8000, "models": ["llama"]}]},
        ratelimit={"enabled": True, "tenants": {"a": {"api_key_sha256": ["0" * 64], "models": {"mistral": {"tokens_per_minute": 5}}}}},
    )
    problems = problem_lines(raw)
    assert problems == [
        "scheduling.metrics.intervl_s: unknown key; did you mean 'interval_s'? (value 0.1)",
        "discovery.sources[1].models: 'llama' is not a configured model name (configured: m)",
        "ratelimit.tenants.a.models: 'mistral' is not a configured model name (configured: m)",
    ]


def test_a_lone_late_problem_is_reported_once_with_its_suggestion():
    with pytest.raises(ConfigError) as info:
        config_from_mapping(minimal(scheduling={"profile": "least-inflite"}), env={})
    assert str(info.value).count("least-inflite") == 1 and "did you mean 'least-inflight'?" in str(info.value)


def test_a_late_problem_is_not_hidden_by_another_line_naming_its_value():
    """The late cross-checks were deduplicated by searching for the value's text in the lines
    already written: an unknown model 'mm' vanished beside an unknown key whose value was 'mm'.
    Two distinct problems are both reported now; one found by both pydantic and the late checks
    (a lone unknown profile, plugin type or model) still once."""
    raw = minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["mm"]}], ratelimit={"tenant_headr": "mm"})
    problems = problem_lines(raw)
    assert problems == [
        "ratelimit.tenant_headr: unknown key; did you mean 'tenant_header'? (value 'mm')",
        "endpoints[0].models: 'mm' is not a configured model name; did you mean 'm'? (configured: m)",
    ]


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        pytest.param(minimal(scheduling={"profile": "least-inflite"}), "scheduling.profile: profile 'least-inflite' is not defined", id="profile"),
        pytest.param(minimal(scheduling={"profiles": {"p": {"filters": [{"type": "nope-filter"}]}}}), "scheduling.profiles.p.filters[0].type: unknown plugin type 'nope-filter'", id="filter"),
        pytest.param(minimal(scheduling={"profiles": {"p": {"picker": {"type": "nope-picker"}}}}), "scheduling.profiles.p.picker.type: unknown plugin type 'nope-picker'", id="picker"),
        pytest.param(minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["mm"]}]), "endpoints[0].models: 'mm' is not a configured model name", id="model"),
        pytest.param(
            minimal(ratelimit={"tenants": {"a": {"api_key_sha256": ["0" * 64], "models": {"mm": {}}}}}),
            "ratelimit.tenants.a.models: 'mm' is not a configured model name",
            id="tenant-model",
        ),
        pytest.param(
            minimal(discovery={"sources": [{"type": "static"}, {"type": "dns", "name": "vllm.svc", "port": 8000, "models": ["mm"]}]}),
            "discovery.sources[1].models: 'mm' is not a configured model name",
            id="source-model",
        ),
    ],
)
def test_a_problem_both_checks_find_is_one_line(raw, line):
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].strip().startswith(line), problems


def test_mapping_keys_in_error_paths_read_as_names_or_quoted_keys():
    """A mapping's key used to print as `.a b` or, when the key itself was wrong, `[1][key]`
    (a list index, to the eye). Now `.name` for a name, `["a b"]` for any other key, and a
    wrong key named as the key of its mapping."""
    endpoint = {"address": "10.0.0.1:8000", "models": ["m"], "labels": {1: "x", "rack zone": 3, "gpu-kind": 4}}
    raw = minimal(
        endpoints=[endpoint],
        scheduling={"profiles": {"my profile": {"scorers": [{"type": "inflight-scorr"}]}}},
        ratelimit={"tenants": {"team a": {"api_key_sha256": ["0" * 64], "models": {"Qwen/Qwen3-8B": {}}}}},
    )
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    paths = [line.strip().split(": ")[0] for line in str(info.value).splitlines()[1:]]
    assert paths == [
        "endpoints[0].labels",  # key 1: ...
        'endpoints[0].labels["rack zone"]',
        "endpoints[0].labels.gpu-kind",
        'scheduling.profiles["my profile"].scorers[0].type',
        'ratelimit.tenants["team a"].models',
    ]
    assert "endpoints[0].labels: key 1: Input should be a valid string" in str(info.value)


def test_path_text_without_the_input_reads_ints_as_indexes():
    from extproc.config_base import path_text

    assert path_text(("models", 1, "name")) == "models[1].name"
    assert path_text(("labels", "a.b", "[key]")) == 'labels["a.b"] (the key)'
    assert path_text(("tenants", "Qwen/Qwen3-8B")) == 'tenants["Qwen/Qwen3-8B"]'


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        pytest.param(
            minimal(scheduling={"profiles": {"p": {"scorers": [{"type": "ttft-estimate-scorer", "params": {"decode_s_per_contxt_token_by_gpu": {}}}]}}}),
            "scheduling.profiles.p.scorers[0]: plugin 'ttft-estimate-scorer': invalid parameters: "
            "decode_s_per_contxt_token_by_gpu: unknown key; did you mean 'decode_s_per_context_token_by_gpu'?",
            id="plugin-params",
        ),
        pytest.param(
            minimal(discovery={"sources": [{"type": "static"}, {"type": "dns", "nmae": "vllm.svc", "name": "vllm.svc", "port": 8000, "models": ["m"]}]}),
            "discovery.sources[1]: dns source: nmae: unknown key; did you mean 'name'?",
            id="source-params",
        ),
    ],
)
def test_a_misspelt_parameter_gets_the_nearest_name(raw, line):
    """A plugin's or a discovery source's parameters are checked by their own schema, whose
    errors came without the suggestion the rest of the configuration gets."""
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    assert line in str(info.value)


def test_a_workers_own_listen_addresses_are_not_blamed_as_user_overrides():
    # `serve --workers` sets each worker's listen addresses in its environment; a config error
    # in a worker named them as "environment overrides" the user never set.
    bad = {**minimal(), "endpoints": [{"address": "not-an-address", "models": ["m"]}]}
    own = {"LLM_EXTPROC_GRPC_ADDRESS": "127.0.0.1:7000", "LLM_EXTPROC_ADMIN_ADDRESS": "127.0.0.1:7001"}
    with pytest.raises(ConfigError) as worker:
        config_from_mapping(bad, env={**own, "LLM_EXTPROC_WORKER": "1"})
    assert "environment overrides" not in str(worker.value)
    with pytest.raises(ConfigError) as user:
        config_from_mapping(bad, env=own)
    assert "LLM_EXTPROC_GRPC_ADDRESS" in str(user.value)  # set by the user: still said


def test_a_late_problem_found_twice_is_one_line():
    """A model named twice in one endpoint's `models` gave its late cross-check line twice when
    another section's error kept pydantic's own cross-check from running (only the lines
    pydantic wrote were checked for repeats, not the late checks' own)."""
    raw = minimal(endpoints=[{"address": "10.0.0.1:8000", "models": ["zz", "zz"]}], scheduling={"bogus": 1})
    problems = problem_lines(raw)
    assert problems == [
        "scheduling.bogus: unknown key (value 1)",
        "endpoints[0].models: 'zz' is not a configured model name (configured: m)",
    ]


@pytest.mark.parametrize(
    ("profiles", "line"),
    [
        pytest.param(
            {"p": {"scorers": [{"type": "ttft-estimate-scorer", "name": "cost"}], "picker": {"type": "max-score-picker", "params": {"lead_scorer": "ttft-estimate-scorer"}}}},
            "scheduling.profiles.p.picker.params.lead_scorer: 'ttft-estimate-scorer' is not a scorer of this profile (scorers: cost); \"\" for none",
            id="renamed-scorer",
        ),
        pytest.param(
            {"p": {"scorers": [{"type": "ttft-estimate-scorer"}], "picker": {"type": "max-score-picker", "params": {"lead_min_score_unmatched": 0.5}}}},
            "scheduling.profiles.p.picker: plugin 'max-score-picker': invalid parameters: lead_min_score_unmatched needs lead_scorer",
            id="floor-without-lead",
        ),
        pytest.param(  # restoring decision 0265's 0.5 on the default profile: the built-in's lead_scorer is not kept
            {"load-aware": {"picker": {"type": "max-score-picker", "params": {"lead_min_score_unmatched": 0.5}}}},
            "(a picker given for a built-in profile replaces the built-in's whole: load-aware's is lead_scorer: ttft-estimate-scorer)",
            id="builtin-picker-replaced-whole",
        ),
    ],
)
def test_a_picker_lead_that_names_no_scorer_is_refused(profiles, line):
    """The picker's lead restriction looked the lead scorer up by name and, finding none, kept
    every candidate: a typo or a renamed TTFT scorer silently turned the lead off, as did a
    floor set without a lead scorer. load-aware's scorers replaced without its TTFT scorer (its
    picker kept) is still a profile without the lead, as asked."""
    with pytest.raises(ConfigError) as info:
        config_from_mapping(minimal(scheduling={"profiles": profiles}), env={})
    assert line in str(info.value)
    fine = {"p": {"scorers": [{"type": "ttft-estimate-scorer", "name": "cost"}], "picker": {"type": "max-score-picker", "params": {"lead_scorer": "cost"}}}}
    config_from_mapping(minimal(scheduling={"profiles": fine}), env={})
    config_from_mapping(minimal(scheduling={"profiles": {"load-aware": {"scorers": [{"type": "queue-depth-scorer"}]}}}), env={})
    typo = {"load-aware": {"picker": {"type": "max-score-picker", "params": {"lead_scorer": "ttft-estimate"}}}}
    with pytest.raises(ConfigError, match="'ttft-estimate' is not a scorer of this profile; did you mean 'ttft-estimate-scorer'"):
        config_from_mapping(minimal(scheduling={"profiles": typo}), env={})


def test_every_cross_check_problem_is_reported_at_once():
    """The sections' cross-checks stopped at their first problem: a model's duplicate name hid
    a duplicate endpoint address, one discovery source's bad parameters the next source's, one
    plugin's bad parameters the next plugin's, one tenant's reused key digest the next one's."""
    digest = "0" * 64
    raw = minimal(
        models=[{"name": "m", "path": "builtin:qwen3-8b"}, {"name": "m", "path": "builtin:qwen3-8b"}],
        endpoints=[{"address": "10.0.0.1:8000", "models": ["m"]}, {"address": "10.0.0.1:8000", "models": ["m"]}],
        discovery={"sources": [{"type": "static"}, {"type": "dns", "name": "a.svc", "models": ["m"]}, {"type": "nope"}]},
        scheduling={"profiles": {"p": {"scorers": [{"type": "inflight-scorer", "params": {"x": 1}}, {"type": "queue-depth-scorer", "params": {"y": 2}}]}}},
        ratelimit={"tenants": {"a": {"api_key_sha256": [digest]}, "b": {"api_key_sha256": [digest]}, "c": {"api_key_sha256": [digest]}}},
    )
    problems = problem_lines(raw)
    assert problems == [
        "discovery.sources[1]: dns source: port: required key is missing",
        "discovery.sources[2]: unknown discovery source type 'nope' (known: static, dns, kubernetes)",
        "scheduling.profiles.p.scorers[0]: plugin 'inflight-scorer': invalid parameters: x: unknown key (value 1)",
        "scheduling.profiles.p.scorers[1]: plugin 'queue-depth-scorer': invalid parameters: y: unknown key (value 2)",
        "ratelimit.tenants.b.api_key_sha256: key digest already listed by tenant 'a'",
        "ratelimit.tenants.c.api_key_sha256: key digest already listed by tenant 'a'",
    ]
    valid_sections = minimal(models=[{"name": "m", "path": "builtin:qwen3-8b"}, {"name": "m", "path": "builtin:qwen3-8b"}], endpoints=raw["endpoints"])
    assert problem_lines(valid_sections) == [
        "models[1]: name or alias 'm' already used by model 'm'",
        "endpoints[1].address: '10.0.0.1:8000' is listed twice",
    ]
    stray = minimal(discovery={"sources": [{"type": "dns", "name": "a.svc", "port": 8000, "models": ["m"]}]}, protocol={"mode": "epp"}, scheduling={"mode": "tier"})
    assert problem_lines(stray) == [
        "protocol.mode: epp picks endpoints; it needs scheduling.mode: endpoint (tier mode routes by cluster)",
        "endpoints are the static source's list: add {type: static} to discovery.sources, or remove them",
    ]


@pytest.mark.parametrize(
    ("key", "value"),
    [("prior_t0_s", float("inf")), ("prior_s_per_token", float("inf")), ("prior_weight", float("inf")), ("gpu_label", "")],
)
def test_the_prefill_prior_takes_finite_figures_and_a_gpu_label(key, value):
    """The GPU table refused inf, the plain prior took it: a prior weight of inf made every
    endpoint's fit NaN at its first sample, an infinite t0 or s every unobserved endpoint's
    cost inf. An empty gpu_label named no label and turned every per-GPU table off unsaid."""
    with pytest.raises(ConfigError, match=rf"scheduling\.prefill_model\.{key}: "):
        config_from_mapping(minimal(scheduling={"prefill_model": {key: value}}), env={})


def test_every_problem_is_one_line_whatever_the_names_hold():
    """A profile named with a line break (a quoted YAML key) broke the "defined: ..." list of an
    unknown profile's message over two lines, which read as two problems."""
    raw = minimal(scheduling={"profile": "nope", "profiles": {"a\nb": {"scorers": [{"type": "inflight-scorer"}]}}})
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith("  scheduling.profile: profile 'nope' is not defined"), problems
    assert "a\\nb, compute-aware" in problems[0]


def test_a_huge_name_is_not_echoed_whole():
    """A megabyte profile name came back whole in its one-line problem (and a log line); now the
    line keeps its start and its end, and says how much it left out."""
    from extproc.config.loader import MAX_PROBLEM_CHARS

    with pytest.raises(ConfigError) as info:
        config_from_mapping(minimal(scheduling={"profile": "x" * 1_000_000}), env={})
    (line,) = str(info.value).splitlines()[1:]
    assert len(line) <= MAX_PROBLEM_CHARS and line.startswith("  scheduling.profile: profile 'xxx")
    assert "characters left out" in line and line.endswith("load-aware, lora, pd-decode, pd-prefill, prefix, random)")


def test_a_null_or_boolean_key_is_named_as_written():
    """pydantic writes a key that is neither a string nor an int as its text and True as 1: a
    YAML `null:` label key read as the string 'None' (`key 'None'`, `.None`) and a `yes:` one
    as the index 1. The key is named as the YAML gave it now."""
    endpoint = {"address": "10.0.0.1:8000", "models": ["m"], "labels": {None: "x", True: "y"}}
    raw = minimal(endpoints=[endpoint], ratelimit={"tenants": {None: None}})
    assert problem_lines(raw) == [
        "endpoints[0].labels: key None: Input should be a valid string",
        "endpoints[0].labels: key True: Input should be a valid string",
        "ratelimit.tenants: key None: Input should be a valid string",
        "ratelimit.tenants[None]: Input should be a valid dictionary or instance of TenantConfig (got None)",
    ]


def test_an_unknown_profile_and_a_bad_lead_scorer_are_both_reported():
    raw = minimal(
        scheduling={
            "profile": "nope",
            "profiles": {"p": {"scorers": [{"type": "inflight-scorer"}], "picker": {"type": "max-score-picker", "params": {"lead_scorer": "x"}}}},
        }
    )
    with pytest.raises(ConfigError) as info:
        config_from_mapping(raw, env={})
    assert [line.strip().split(":")[0] for line in str(info.value).splitlines()[1:]] == [
        "scheduling.profile",
        "scheduling.profiles.p.picker.params.lead_scorer",
    ]


def test_the_largest_plausible_attention_ratio_is_accepted():
    from extproc.config.schema import MAX_ATTENTION_RATIO

    raw = minimal(scheduling={"prefill_model": {"attention_ratio": MAX_ATTENTION_RATIO}})
    assert config_from_mapping(raw, env={}).scheduling.prefill_model.attention_ratio == MAX_ATTENTION_RATIO


def test_a_key_written_as_the_key_mark_reads_as_a_key():
    """A label or profile the user named "[key]" read as pydantic's mark for a wrong key: the
    error blamed the mapping's own key (`endpoints[0]: key 'labels'`)."""
    from extproc.config_base import path_text

    labels = {"address": "10.0.0.1:8000", "models": ["m"], "labels": {"[key]": 5}}
    profiles = {"profiles": {"[key]": {"scorers": [{"type": "nope-scorer"}]}}}
    for raw, path in [
        (minimal(endpoints=[labels]), 'endpoints[0].labels["[key]"]: Input should be a valid string (got 5)'),
        (minimal(scheduling=profiles), 'scheduling.profiles["[key]"].scorers[0].type: unknown plugin type'),
    ]:
        with pytest.raises(ConfigError) as info:
            config_from_mapping(raw, env={})
        problems = str(info.value).splitlines()[1:]
        assert len(problems) == 1 and problems[0].strip().startswith(path), problems
    assert path_text(("labels", "[key]"), {"labels": {"[key]": 5}}) == 'labels["[key]"]'
    assert path_text(("labels", "[key]", "[key]"), {"labels": {"[key]": 5}}) == 'labels["[key]"] (the key)'


def _model(**fields):
    return {"models": [fields], "endpoints": [{"address": "10.0.0.1:8000", "models": [fields["name"]]}]}


@pytest.mark.parametrize(
    ("entry", "needles"),
    [
        # The issue's config: it passed and served with Qwen3's tokenizer and Qwen3-8B's shape.
        ({"name": "meta-llama/Llama-3.1-70B-Instruct", "max_model_len": 131072},
         ["models[0]: model 'meta-llama/Llama-3.1-70B-Instruct' matches no built-in tokenizer", "`path:`",
          "`tokenizer`", "tokenizer.json", "config.json", "{name: meta-llama/Llama-3.1-70B-Instruct, path: /models/Llama-3.1-70B-Instruct}"]),
        ({"name": "mistralai/Mistral-7B-Instruct-v0.3"}, ["no built-in tokenizer or architecture", "`tokenizer` and `architecture`"]),
        ({"name": "Qwen/Qwen3-4B"}, ["matches no built-in architecture", "its `architecture`"]),
        ({"name": "Qwen/Qwen3-4B-Instruct-2507"}, ["no built-in tokenizer or architecture"]),  # another chat template
        ({"name": "m", "path": "builtin:qwen3-4b"}, ["path 'builtin:qwen3-4b'", "['qwen3-32b', 'qwen3-8b']"]),
        ({"name": "m", "path": 3}, ["path must be a model directory"]),
    ],
    ids=["llama", "mistral", "qwen3-4b-shape", "qwen3-2507", "partial-builtin-path", "path-not-a-string"],
)
def test_a_model_no_builtin_serves_must_name_its_tokenizer_and_architecture(entry, needles):
    """No silent default: a name that matches no built-in is refused until it names its own."""
    text = "\n".join(problem_lines(_model(**entry)))
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize(
    ("entry", "tokenizer", "architecture"),
    [
        ({"name": "Qwen/Qwen3-8B"}, "builtin:qwen3", "builtin:qwen3-8b"),
        ({"name": "qwen3-32b-fp8"}, "builtin:qwen3", "builtin:qwen3-32b"),
        ({"name": "Qwen/Qwen3-4B", "architecture": "builtin:qwen3-8b"}, "builtin:qwen3", "builtin:qwen3-8b"),
        ({"name": "meta-llama/Llama-3.1-70B-Instruct", "tokenizer": "/models/llama"}, "/models/llama", "builtin:llama-3.1-70b"),
        ({"name": "m", "path": "builtin:qwen3-32b"}, "builtin:qwen3", "builtin:qwen3-32b"),
        ({"name": "m", "tokenizer": "builtin:qwen3", "architecture": "builtin:qwen3-8b"}, "builtin:qwen3", "builtin:qwen3-8b"),
    ],
    ids=["qwen3-8b", "quantized-32b", "shape-given", "llama-tokenizer-given", "builtin-path", "both-given"],
)
def test_built_ins_fill_in_only_for_the_models_they_belong_to(entry, tokenizer, architecture):
    m = config_from_mapping(_model(**entry), env={}).models[0]
    assert (m.tokenizer, m.architecture) == (tokenizer, architecture)


def test_a_model_directory_supplies_both_tokenizer_and_architecture(tmp_path):
    """`path:` is the directory the engines load: its tokenizer files and its config.json."""
    from extproc.models import builtin_tokenizer_dir

    model_dir = tmp_path / "Llama-like"
    shutil.copytree(builtin_tokenizer_dir("qwen3"), model_dir)
    shutil.copy(ARCHITECTURES_DIR / "llama-3.1-8b.json", model_dir / "config.json")
    m = config_from_mapping(_model(name="acme/house-model", path=str(model_dir)), env={}).models[0]
    assert (m.tokenizer, m.architecture, m.path) == (str(model_dir), str(model_dir), str(model_dir))
    (model_dir / "config.json").unlink()
    assert "No such file" in "\n".join(problem_lines(_model(name="acme/house-model", path=str(model_dir))))
    # A directory that is not there: one line naming `path` and what it should hold.
    missing = problem_lines(_model(name="acme/house-model", path=str(tmp_path / "typo")))
    assert len(missing) == 1 and f"path '{tmp_path / 'typo'}': no such directory;" in missing[0], missing
    assert "config.json" in missing[0] and "`tokenizer` and `architecture`" in missing[0]
