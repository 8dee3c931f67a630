"""Config files as read: ``${VAR}`` / ``${VAR:default}`` expanded as Primus's loader does, Primus's spellings taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffprep.config import check_runnable, load_settings, read_yaml
from diffprep.config.files import expand_variables
from diffprep.errors import ConfigError


def write_yaml(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _no_test_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DP_ROOT", "DP_UNSET", "DP_EMPTY", "DP_NUM", "PRIMUS_DATA_ROOT"):
        monkeypatch.delenv(name, raising=False)


# Variables


def test_a_default_is_used_when_the_variable_is_unset_and_the_variable_when_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_yaml(tmp_path, "output:\n  output_dir: ${DP_ROOT:/workspace/Primus/data}/encoded_pokemon\n")
    assert load_settings(config).output.output_dir == "/workspace/Primus/data/encoded_pokemon"
    monkeypatch.setenv("DP_ROOT", str(tmp_path))
    assert load_settings(config).output.output_dir == f"{tmp_path}/encoded_pokemon"


def test_a_variable_set_to_the_empty_string_wins_over_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_EMPTY", "")
    assert expand_variables("${DP_EMPTY:/default}/x") == "/x"


def test_an_unset_variable_without_default_is_named_with_its_key(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "source:\n  input_dir: /data\noutput:\n  output_dir: ${DP_UNSET}/out\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert str(caught.value) == (f"{config}: output.output_dir uses ${{DP_UNSET}}, but the environment variable "
                                 "DP_UNSET is not set: set it, or give a default as ${DP_UNSET:default}")


def test_every_string_is_expanded_in_mappings_and_lists_but_not_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_ROOT", "/r")
    data = {"${DP_ROOT}": {"a": ["${DP_ROOT}/x", 3, None, {"b": "${DP_UNSET:d}"}], "c": "plain"}}
    assert expand_variables(data) == {"${DP_ROOT}": {"a": ["/r/x", 3, None, {"b": "d"}], "c": "plain"}}


def test_a_default_may_hold_colons_and_one_pass_leaves_a_nested_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    assert expand_variables("${DP_UNSET:http://host:9000/b}") == "http://host:9000/b"
    # One pass, as Primus's loader: the default '${DP_ROOT' is taken as written, and the '}' after it stays.
    monkeypatch.setenv("DP_ROOT", "/r")
    assert expand_variables("${DP_UNSET:${DP_ROOT}}") == "${DP_ROOT}"


@pytest.mark.parametrize(("value", "expected"), [
    ("8", 8), ("-3", -3), ("0.5", 0.5), ("1.", 1.0), (".5", 0.5), ("1e3", 1000.0), ("-1.5E-2", -0.015),
    ("true", True), ("FALSE", False), ("+1", "+1"), ("1_000", "1_000"), ("nan", "nan"), ("inf", "inf"),
    (".", "."), ("1.2.3", "1.2.3"), ("e5", "e5"), ("null", "null"), (" 8", " 8"),
])
def test_a_replaced_value_that_reads_as_a_bool_or_number_becomes_one(
        value: str, expected: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_NUM", value)
    result = expand_variables("${DP_NUM}")
    assert result == expected and type(result) is type(expected)


def test_a_value_without_a_variable_keeps_its_yaml_type(tmp_path: Path) -> None:
    assert expand_variables("8") == "8"  # a quoted '8' in YAML stays a string, as in Primus's loader
    config = write_yaml(tmp_path, "model:\n  batch_size: ${DP_NUM:16}\n")
    assert load_settings(config).model.batch_size == 16


def test_a_path_that_still_holds_a_variable_is_refused_wherever_it_comes_from(tmp_path: Path) -> None:
    unclosed = write_yaml(tmp_path, "source:\n  input_dir: /data\noutput:\n  output_dir: ${DP_ROOT/out\n")
    with pytest.raises(ConfigError, match=r"output\.output_dir: Value error, output_dir '\$\{DP_ROOT/out' still "
                                          r"holds '\$\{', an unexpanded variable"):
        load_settings(unclosed)
    for section, key in (("output", "output_dir"), ("source", "input_dir"), ("model", "model_path"),
                         ("auth", "hf_token_file")):
        with pytest.raises(ConfigError, match=rf"{section}\.{key}: .*still holds"):
            load_settings(overrides={section: {key: "${PRIMUS_DATA_ROOT:/w}/x"}})
    assert not [path for path in tmp_path.rglob("*") if "${" in path.name]


# Primus's spellings


def test_data_format_sets_the_source_keys(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "source:\n  type: huggingface\n  hf_dataset: d\n"
                                  "data_format:\n  image_key: jpg\n  caption_key: json.prompt\n")
    assert read_yaml(config)["source"] == {"type": "huggingface", "hf_dataset": "d", "image_key": "jpg",
                                           "caption_key": "json.prompt"}
    source = load_settings(config).source
    assert (source.image_key, source.caption_key) == ("jpg", "json.prompt")


def test_data_format_alone_makes_a_source_section_and_empty_values_mean_detection(tmp_path: Path) -> None:
    assert read_yaml(write_yaml(tmp_path, "data_format:\n  caption_key: prompt\n")) == {
        "source": {"caption_key": "prompt"}}
    config = write_yaml(tmp_path, "data_format:\n  image_key: ''\n  caption_key: null\n", "empty.yaml")
    source = load_settings(config).source
    assert (source.image_key, source.caption_key) == (None, None)


def test_a_fallback_list_wins_over_the_single_key_as_in_primus(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "data_format:\n  image_key: image\n  image_keys: [jpg, jpg, '']\n"
                                  "  caption_key: caption\n  caption_keys: null\n")
    source = load_settings(config).source
    assert (source.image_key, source.caption_key) == ("jpg", "caption")


def test_a_fallback_list_of_several_fields_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "data_format:\n  caption_keys: [prompt, json.prompt, caption]\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(config)
    assert str(caught.value) == (
        f"{config}: data_format.caption_keys lists several fallbacks ['prompt', 'json.prompt', 'caption']; diffprep "
        "reads one field per dataset: set data_format.caption_key (diffprep: source.caption_key, --caption-key) to "
        "the one this dataset has, or remove both to let diffprep detect it")
    for bad, message in (("[]", "is empty"), ("jpg", "must be a list of field names")):
        with pytest.raises(ConfigError, match=message):
            read_yaml(write_yaml(tmp_path, f"data_format:\n  image_keys: {bad}\n", "bad.yaml"))


def test_an_unknown_data_format_key_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "data_format:\n  image_field: jpg\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(config)
    assert str(caught.value) == (f"{config}: unknown key 'image_field' in section 'data_format' (Primus's field "
                                 "names); valid keys: image_key, caption_key, image_keys, caption_keys")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_yaml(write_yaml(tmp_path, "data_format: jpg\n", "flat.yaml"))


def test_a_primus_key_and_its_diffprep_key_with_other_values_are_refused(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "source:\n  image_key: png\ndata_format:\n  image_key: jpg\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(config)
    assert str(caught.value) == (f"{config}: data_format.image_key (Primus's name for source.image_key) means "
                                 "image_key: 'jpg', but source.image_key is 'png': keep one of the two")
    same = write_yaml(tmp_path, "model:\n  latent_mode: posterior\n  vae_latent_mode: resample\n", "same.yaml")
    assert load_settings(same).model.latent_mode == "posterior"
    clash = write_yaml(tmp_path, "model:\n  latent_mode: mode\n  vae_latent_mode: presampled\n", "clash.yaml")
    with pytest.raises(ConfigError, match="means latent_mode: 'sample', but model.latent_mode is 'mode'"):
        read_yaml(clash)


@pytest.mark.parametrize(("primus", "diffprep"), [("presampled", "sample"), ("resample", "posterior"),
                                                  ("null", "sample")])
def test_vae_latent_mode_is_primus_name_for_latent_mode(tmp_path: Path, primus: str, diffprep: str) -> None:
    config = write_yaml(tmp_path, f"model:\n  vae_latent_mode: {primus}\n")
    assert load_settings(config).model.latent_mode == diffprep


def test_a_latent_mode_override_still_beats_the_primus_spelling_in_the_file(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  vae_latent_mode: resample\n")
    assert load_settings(config, {"model": {"latent_mode": "mode"}}).model.latent_mode == "mode"


def test_an_unknown_vae_latent_mode_is_refused_with_both_names(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "model:\n  vae_latent_mode: posterior\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(config)
    assert str(caught.value) == (f"{config}: model.vae_latent_mode must be one of ['presampled', 'resample'] "
                                 "(Primus's names for model.latent_mode sample / posterior), got 'posterior'")


def test_an_unknown_model_key_lists_the_valid_keys_and_primus_spelling(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'vae_mode' in section 'model'; valid keys: model_path, .*"
                                          r"; Primus's spellings: vae_latent_mode \(= model.latent_mode\)$"):
        read_yaml(write_yaml(tmp_path, "model:\n  vae_mode: resample\n"))
    with pytest.raises(ConfigError, match=r"unknown section 'dataformat'; valid sections: source, .*, workers, "
                                          r"and Primus's data_format$"):
        read_yaml(write_yaml(tmp_path, "dataformat:\n  image_key: jpg\n", "section.yaml"))


@pytest.mark.parametrize("value", ['""', "'  '", "null"])
def test_an_empty_hf_token_file_means_no_token_file(tmp_path: Path, value: str) -> None:
    config = write_yaml(tmp_path, f"source:\n  input_dir: /data\noutput:\n  output_dir: {tmp_path}/out\n"
                                  f"auth:\n  hf_token_file: {value}\n")
    settings = load_settings(config)
    assert settings.auth.hf_token_file is None
    check_runnable(settings)
    assert load_settings(overrides={"auth": {"hf_token_file": ""}}).auth.hf_token_file is None


# What a config does that its keys alone do not make plain


def test_a_primus_config_with_center_crop_off_says_in_the_plan_log_and_the_summary_that_images_are_stretched(
        tmp_path: Path, demo_data: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    import json
    import tarfile

    from diffprep.cli import print_summary
    from diffprep.phases.pipeline import run

    # Primus's keys and nesting (tests/primus_configs/example_directory.yaml), small; its center_crop: false.
    text = (f"source:\n  type: directory\n  input_dir: {demo_data}\noutput:\n  output_dir: {tmp_path / 'out'}\n"
            "  shard_size: 1000\n  max_samples: null\n  compress: false\nimage:\n  image_size: 64\n"
            "  center_crop: false\nfinalize:\n  enabled: false\n")
    settings = load_settings(write_yaml(tmp_path, text))
    with caplog.at_level("INFO", logger="diffprep"):
        result = run(settings, "raw", ask=lambda question: pytest.fail("asked"))
    said = "images are stretched to 64x64, not cropped (image.center_crop is off)"
    assert any(said in record.getMessage() for record in caplog.records if record.name == "diffprep.phases.fetch")
    print_summary(result.to_json(), settings)
    assert said in capsys.readouterr().out
    # And so they are: a 160x112 source image's whole frame is in its stored 64x64 image.
    with tarfile.open(tmp_path / "out" / "000000.tar") as tar:
        metas = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".meta.json")]
    wide = [meta for meta in metas if meta["original_size"] == [160, 112]]
    assert wide and all(meta["crop_box"] == [0, 0, 160, 112] for meta in wide)
    # Cropped (the default), nothing to say.
    cropped = load_settings(write_yaml(tmp_path, text.replace("center_crop: false", "center_crop: true"), "c.yaml"))
    print_summary(result.to_json(), cropped)
    assert "stretched" not in capsys.readouterr().out
