"""Settings: the priority of their sources, and errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffprep.config import (
    SECTIONS,
    ImageConfig,
    ModelConfig,
    OutputConfig,
    check_runnable,
    load_settings,
    read_yaml,
)
from diffprep.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
# Collected when the tests are collected: every shipped example config must load.
SHIPPED_CONFIGS = sorted(REPO.glob("configs/*.yaml"))


def write_yaml(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# Priority: defaults < YAML < env < explicit overrides


def test_defaults_without_any_source() -> None:
    settings = load_settings()
    assert settings.model.batch_size == ModelConfig.model_fields["batch_size"].default == 8
    assert settings.output.shard_size == 1000
    assert settings.image.image_size == 1024
    assert settings.source.type is None


def test_yaml_beats_defaults_and_keeps_other_defaults(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: 16\nimage:\n  image_size: 64\n")
    settings = load_settings(config)
    assert settings.model.batch_size == 16
    assert settings.image.image_size == 64
    assert settings.model.precision == "bf16"  # untouched default of the same section


def test_env_beats_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: 16\n  precision: fp32\n")
    monkeypatch.setenv("DIFFPREP_MODEL__BATCH_SIZE", "12")
    settings = load_settings(config)
    assert settings.model.batch_size == 12
    assert settings.model.precision == "fp32"  # the env var for one field keeps YAML's other fields


def test_override_beats_env_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: 16\n")
    monkeypatch.setenv("DIFFPREP_MODEL__BATCH_SIZE", "12")
    assert load_settings(config, {"model": {"batch_size": 5}}).model.batch_size == 5


def test_override_equal_to_default_still_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: 16\n")
    monkeypatch.setenv("DIFFPREP_MODEL__BATCH_SIZE", "12")
    default = ModelConfig.model_fields["batch_size"].default
    assert default == 8
    assert load_settings(config, {"model": {"batch_size": default}}).model.batch_size == 8


def test_override_of_one_field_keeps_yaml_and_env_for_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: 16\n  precision: fp32\n")
    monkeypatch.setenv("DIFFPREP_MODEL__T5_MAX_LENGTH", "256")
    settings = load_settings(config, {"model": {"device": "cpu"}})
    model = settings.model
    assert (model.batch_size, model.precision, model.t5_max_length, model.device) == (16, "fp32", 256, "cpu")


def test_empty_yaml_section_is_allowed(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\nimage:\n  image_size: 32\n")
    assert read_yaml(config) == {"model": {}, "image": {"image_size": 32}}
    assert load_settings(config).model.batch_size == 8


# YAML errors


def test_unknown_yaml_key_names_key_and_section(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  batchsize: 16\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(config)
    message = str(info.value)
    assert "'batchsize'" in message
    assert "'model'" in message
    assert "batch_size" in message  # the valid keys are listed
    assert str(config) in message


def test_unknown_yaml_section_is_named(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "models:\n  batch_size: 16\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    message = str(info.value)
    assert "unknown section 'models'" in message
    for section in SECTIONS:
        assert section in message


def test_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  - batch_size\n")
    with pytest.raises(ConfigError, match=r"section 'model' must be a mapping, got list"):
        read_yaml(config)


def test_top_level_that_is_not_a_mapping(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "- model\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections .*got list"):
        read_yaml(config)


def test_missing_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        read_yaml(tmp_path / "absent.yaml")
    broken = write_yaml(tmp_path, "model: [unclosed\n", name="broken.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(broken)


def test_bad_yaml_value_names_the_field(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  batch_size: lots\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert "model.batch_size" in str(info.value)
    assert "'lots'" in str(info.value)


def test_bad_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFPREP_OUTPUT__SHARD_SIZE", "0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "output.shard_size" in str(info.value)
    assert "greater than or equal to 1" in str(info.value)


def test_unknown_env_key_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFPREP_MODEL__BATCHSIZE", "3")
    with pytest.raises(ConfigError, match=r"model\.batchsize: Extra inputs are not permitted \(got '3'\)"):
        load_settings()


def test_bad_override_value_and_literal_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides={"model": {"precision": "int8"}})
    message = str(info.value)
    assert "model.precision" in message
    assert "'int8'" in message
    assert "'bf16'" in message and "'fp32'" in message  # pydantic lists the allowed literals


def test_unknown_override_section_and_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown section 'modle'"):
        load_settings(overrides={"modle": {"batch_size": 1}})
    with pytest.raises(ConfigError, match=r"unknown setting model\.batchsize"):
        load_settings(overrides={"model": {"batchsize": 1}})


@pytest.mark.parametrize("field", ["image_size", "max_size"])
def test_image_sizes_must_be_multiples_of_16(field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides={"image": {field: 40}})
    assert f"{field} must be a multiple of 16, got 40" in str(info.value)
    assert getattr(load_settings(overrides={"image": {field: 48}}).image, field) == 48


def test_image_size_bounds() -> None:
    assert ImageConfig.model_fields["image_size"].default == 1024
    with pytest.raises(ConfigError, match=r"image\.image_size"):
        load_settings(overrides={"image": {"image_size": 0}})


# check_runnable


def runnable(tmp_path: Path, **sections: dict) -> dict:
    overrides = {
        "source": {"type": "directory", "input_dir": str(tmp_path / "in")},
        "output": {"output_dir": str(tmp_path / "out")},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    return overrides


def test_check_runnable_accepts_a_complete_setup(tmp_path: Path) -> None:
    check_runnable(load_settings(overrides=runnable(tmp_path)))


def test_check_runnable_needs_a_source_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        check_runnable(load_settings(overrides={"output": {"output_dir": str(tmp_path)}}))
    assert "source.type is not set and no source location is set" in str(info.value)
    assert "--source-type directory|huggingface|webdataset|metadata" in str(info.value)


@pytest.mark.parametrize(("field", "kind"), [("input_dir", "directory"), ("hf_dataset", "huggingface"),
                                             ("input_path", "webdataset"), ("metadata_file", "metadata")])
def test_a_source_location_alone_gives_its_type(tmp_path: Path, field: str, kind: str) -> None:
    settings = load_settings(overrides={"source": {field: "somewhere"}, "output": {"output_dir": str(tmp_path)}})
    assert settings.source.type == kind
    check_runnable(settings)
    # An explicit type is kept, even where the location names another kind's field.
    explicit = load_settings(overrides={"source": {field: "somewhere", "type": "webdataset"}})
    assert explicit.source.type == "webdataset"


def test_two_source_locations_without_a_type_are_refused_by_name(tmp_path: Path) -> None:
    settings = load_settings(overrides={"source": {"input_dir": "a", "hf_dataset": "b"},
                                        "output": {"output_dir": str(tmp_path)}})
    assert settings.source.type is None
    with pytest.raises(ConfigError, match=r"several source locations are set \(source\.input_dir, "
                                          r"source\.hf_dataset\): pass --source-type"):
        check_runnable(settings)


@pytest.mark.parametrize(
    ("source_type", "needed", "flag"),
    [("directory", "input_dir", "--input-dir"), ("huggingface", "hf_dataset", "--hf-dataset"),
     ("webdataset", "input_path", "--input-path")],
)
def test_check_runnable_needs_the_source_location(tmp_path: Path, source_type: str, needed: str, flag: str) -> None:
    settings = load_settings(overrides={"source": {"type": source_type}, "output": {"output_dir": str(tmp_path)}})
    with pytest.raises(ConfigError) as info:
        check_runnable(settings)
    assert f"source.{needed} is not set" in str(info.value)
    assert flag in str(info.value)


def test_check_runnable_needs_an_output_dir(tmp_path: Path) -> None:
    overrides = runnable(tmp_path)
    del overrides["output"]
    with pytest.raises(ConfigError, match=r"output\.output_dir is not set \(pass --output-dir\)"):
        check_runnable(load_settings(overrides=overrides))


def test_check_runnable_refuses_compression_with_the_reason(tmp_path: Path) -> None:
    assert OutputConfig.model_fields["compress"].default is False
    with pytest.raises(ConfigError) as info:
        check_runnable(load_settings(overrides=runnable(tmp_path, output={"compress": True})))
    message = str(info.value)
    assert "output.compress is refused" in message
    assert "Energon" in message and "uncompressed" in message
    assert "Remove --compress" in message


# Shipped example configs (the folder may be empty while the project grows).


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=[p.name for p in SHIPPED_CONFIGS])
def test_shipped_config_loads(config: Path) -> None:
    data = read_yaml(config)
    assert set(data) <= set(SECTIONS)
    settings = load_settings(config)
    for section, values in data.items():
        loaded = getattr(settings, section).model_dump(mode="json")
        for key, value in values.items():
            assert loaded[key] == value, f"{config.name}: {section}.{key}"
