"""Profiles load, validate and report errors by file and field."""

import pytest

from eagle3.config import ConfigError, config_from_dict, load_config, parse_override
from tests.conftest import CPU_PROFILE, KIMI_PROFILE


def test_cpu_profile_loads():
    cfg = load_config(CPU_PROFILE)
    assert cfg.target.is_embedded and cfg.target.embedded_name == "smollm2-135m-instruct"
    assert cfg.serve.backend == "process" and cfg.serve.host == "127.0.0.1"
    assert cfg.aux_layers == [2, 15, 27]  # default (2, N//2, N-3) for 30 layers


def test_kimi_profile_has_the_seed_settings():
    cfg = load_config(KIMI_PROFILE)
    t, s, g = cfg.target, cfg.serve, cfg.generate
    assert (
        t.model == "moonshotai/Kimi-K2.5" and t.num_hidden_layers == 61 and t.vocab_size == 163840
    )
    assert (t.think_start_id, t.think_end_id) == (163606, 163607) and t.expects_reasoning
    assert s.backend == "systemd" and s.unit == "vllm-kimi-k25-int4" and s.tensor_parallel_size == 8
    assert s.reasoning_parser == "kimi_k2" and s.host == "127.0.0.1"
    assert s.ready_timeout_s >= 45 * 60
    assert (g.concurrency, g.concurrency_ceiling, g.max_tokens, g.timeout_s) == (
        128,
        200,
        8192,
        1800,
    )
    assert (g.dataset, g.num_samples) == ("mlabonne/open-perfectblend", 10000)
    assert cfg.aux_layers == [2, 30, 58]
    assert cfg.vocab.draft_vocab_size == 32000 and cfg.train.epochs == 10


def test_overrides_are_typed_yaml():
    cfg = load_config(
        CPU_PROFILE, ["train.epochs=3", "extract.aux_layers=[1, 5, 9]", "serve.env.FOO=bar"]
    )
    assert cfg.train.epochs == 3
    assert cfg.aux_layers == [1, 5, 9]
    assert cfg.serve.env["FOO"] == "bar" and cfg.serve.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert parse_override("generate.concurrency=auto") == (["generate", "concurrency"], "auto")


def test_on_off_settings_survive_yaml_booleans(tmp_path):
    # YAML 1.1 reads a bare on / off as true / false; `-s train.data_on_device=on` failed with
    # "Input should be 'auto', 'on' or 'off'" (session 8, on the GPU machine). Profiles and
    # overrides are read as YAML 1.2: only true / false are booleans.
    for value in ("on", "off", "auto"):
        cfg = load_config(CPU_PROFILE, [f"train.data_on_device={value}", f"train.prefetch={value}"])
        assert cfg.train.data_on_device == value and cfg.train.prefetch == value
    profile = tmp_path / "p.yaml"
    profile.write_text(
        CPU_PROFILE.read_text().replace(
            "train:\n", "train:\n  prefetch: off\n  data_on_device: on\n"
        )
    )
    cfg = load_config(profile)
    assert (cfg.train.prefetch, cfg.train.data_on_device) == ("off", "on")
    assert parse_override("a.b=yes") == (["a", "b"], "yes")
    assert parse_override("a.b=true")[1] is True and parse_override("a.b=False")[1] is False


def test_broken_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text(CPU_PROFILE.read_text().replace("  port: 0", "  port: [0"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "not valid YAML at line" in str(e.value)


def test_unknown_field_names_file_and_field(tmp_path):
    p = tmp_path / "typo.yaml"
    p.write_text(CPU_PROFILE.read_text().replace("  epochs: 2", "  epochz: 2"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "train.epochz: unknown field" in msg


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"override.yaml.*\n.*train\.epochs"):
        config_from_dict(_cpu_dict(), "override.yaml", ["train.epochs=many"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("extract.aux_layers=[2, 3, 3]", "must be distinct"),
        ("extract.aux_layers=[2, 15, 30]", "outside the target's 30 layers"),
        ("vocab.draft_vocab_size=100000", "exceeds target.vocab_size"),
        ("serve.backend=systemd", "needs serve.unit"),
        ("serve.backend=external", "needs serve.base_url"),
        ("generate.concurrency=0", "concurrency must be positive"),
        ("target.think_start_id=5", "must be set together"),
    ],
)
def test_cross_field_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_cpu_dict(), "p.yaml", [override])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected section.field=value"):
        parse_override("train.epochs")
    with pytest.raises(ConfigError, match="is not a section"):
        config_from_dict(_cpu_dict(), "p.yaml", ["name.x=1"])


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_config(tmp_path / "nope.yaml")


def _cpu_dict():
    import yaml

    return yaml.safe_load(CPU_PROFILE.read_text())


def test_default_aux_layers_that_collide_name_the_fix():
    """(2, N//2, N-3) collides on very shallow targets (6 layers: 2, 3, 3): the error says it is the
    default and what to set instead."""
    with pytest.raises(ConfigError) as e:
        config_from_dict(_cpu_dict(), "p.yaml", ["target.num_hidden_layers=6"])
    msg = str(e.value)
    assert (
        "extract.aux_layers [2, 3, 3] must be distinct" in msg and "default (2, N//2, N-3)" in msg
    )
    assert "set extract.aux_layers to distinct layer ids in [0, 6), e.g. [1, 3, 4]" in msg
    with pytest.raises(ConfigError, match=r"outside the target's 2 layers; these are the default"):
        config_from_dict(_cpu_dict(), "p.yaml", ["target.num_hidden_layers=2"])
    cfg = config_from_dict(
        _cpu_dict(), "p.yaml", ["target.num_hidden_layers=6", "extract.aux_layers=[1, 3, 4]"]
    )
    assert cfg.aux_layers == [1, 3, 4]
    with pytest.raises(ConfigError) as e:  # an explicit list gets the plain message
        config_from_dict(_cpu_dict(), "p.yaml", ["extract.aux_layers=[2, 3, 3]"])
    assert "default" not in str(e.value)
