"""Model resolution and authentication: local folders, partial hub downloads, refusals, token files.

The hub is replaced by a stand-in for ``snapshot_download`` that serves a tiny
model folder through huggingface_hub's own pattern filter, and hub errors are
made by huggingface_hub's own ``hf_raise_for_status`` from real HTTP responses.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects, hf_raise_for_status

from diffprep.config import ModelConfig
from diffprep.families.flux import resolve_encoders
from diffprep.families.hub import resolve_component, resolve_token
from diffprep.errors import AuthError, ConfigError, OfflineError
from diffprep.families.flux_tiny import write_tiny_model

REPO = "black-forest-labs/FLUX.1-dev"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_SecretTokenValue1234567890"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "flux")


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch):
    # The developer's own HF_TOKEN must not leak into what these tests see.
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


# Token files


def test_token_file_mode_600_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    assert resolve_token(path) == TOKEN  # the file wins over the environment


@pytest.mark.parametrize("mode", ["644", "640", "604"])
def test_token_file_readable_by_others_is_refused_with_the_fix(tmp_path, mode):
    path = tmp_path / "my token"
    path.write_text(TOKEN)
    path.chmod(int(mode, 8))
    with pytest.raises(ConfigError) as info:
        resolve_token(path)
    message = str(info.value)
    assert f"chmod 600 '{path}'" in message
    assert f"mode {mode}" in message
    assert TOKEN not in message


def test_empty_or_missing_token_file_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    empty.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        resolve_token(empty)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_token(tmp_path / "absent")


def test_token_from_env_else_none(monkeypatch):
    assert resolve_token(None) is None
    monkeypatch.setenv("HF_TOKEN", " hf_from_env ")
    assert resolve_token(None) == "hf_from_env"


# Local folders


def test_local_full_layout_and_direct_component(tiny):
    assert resolve_component(str(tiny), "vae") == (tiny.resolve(), "vae")
    assert resolve_component(str(tiny / "vae"), "vae") == ((tiny / "vae").resolve(), None)


def test_local_folder_without_the_component_lists_its_content(tiny):
    with pytest.raises(ConfigError) as info:
        resolve_component(str(tiny / "tokenizer"), "vae", encoder="VAE")
    message = str(info.value)
    assert message.startswith("VAE:")
    assert "vae/" in message and "config.json" in message
    assert "tokenizer.json" in message  # what is there


def test_local_path_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="revision applies to hub repos only"):
        resolve_component(str(tiny), "vae", revision="main")
    with pytest.raises(ConfigError, match="not an existing folder"):
        resolve_component(str(tmp_path / "missing"), "vae")
    with pytest.raises(ConfigError, match="is a file"):
        resolve_component(str(tiny / "model_index.json"), "vae")


def test_resolve_encoders_with_overrides(tiny):
    model = ModelConfig(model_path=str(tiny), vae_path=str(tiny / "vae"), t5_path=str(tiny))
    parts = resolve_encoders(model)
    assert parts["vae"].path == (tiny / "vae").resolve() and parts["vae"].subfolder is None
    assert parts["t5_text"].path == (tiny / "text_encoder_2").resolve()
    assert parts["t5_tokenizer"].path == (tiny / "tokenizer_2").resolve()
    assert parts["clip_tokenizer"].path == (tiny / "tokenizer").resolve()
    for name in ("clip_text", "clip_tokenizer", "t5_text", "t5_tokenizer"):
        assert parts[name].commit is None and parts[name].source == str(tiny.resolve())


def test_direct_folder_without_tokenizer_is_refused(tiny):
    # text_encoder/ holds a config.json (so it is taken as the component itself) but no tokenizer.
    with pytest.raises(ConfigError) as info:
        resolve_encoders(ModelConfig(model_path=str(tiny), clip_path=str(tiny / "text_encoder")))
    message = str(info.value)
    assert message.startswith("CLIP:") and "tokenizer_config.json" in message and "model.clip_path" in message


# Hub downloads


class FakeHub:
    """Serves folders as hub repos through huggingface_hub's own allow/ignore filter; records each call."""

    def __init__(self, cache: Path, repos: dict[str, Path]) -> None:
        self.cache = cache
        self.repos = repos
        self.calls: list[dict] = []

    def __call__(self, repo_id, *, revision=None, token=None, allow_patterns=None, ignore_patterns=None, **kwargs):
        call = {"repo_id": repo_id, "revision": revision, "token": token}
        self.calls.append({**call, "allow": allow_patterns, "ignore": ignore_patterns})
        source = self.repos[repo_id]
        files = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
        snapshot = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, snapshot / name)
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(snapshot)

    def fetched(self) -> set[str]:
        return {str(p.relative_to(self.cache)).split(COMMIT + "/")[1] for p in self.cache.rglob("*") if p.is_file()}


@pytest.fixture
def remote_flux(tiny, tmp_path) -> Path:
    """The tiny model with a transformer/ folder, as the real repo has one."""
    repo = tmp_path / "remote"
    shutil.copytree(tiny, repo)
    (repo / "transformer").mkdir()
    (repo / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"never download me")
    return repo


def test_hub_downloads_only_the_needed_subfolders(remote_flux, tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "cache", {REPO: remote_flux})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    parts = resolve_encoders(ModelConfig(model_path=REPO, revision="main"), token=TOKEN)

    subfolders = ["vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
    assert [call["allow"] for call in fake.calls] == [
        [f"{sub}/*", "model_index.json", "config.json"] for sub in subfolders
    ]
    assert all(call["revision"] == "main" and call["token"] == TOKEN for call in fake.calls)
    fetched = fake.fetched()
    assert not any(name.startswith(("transformer/", "scheduler/")) for name in fetched)
    assert "vae/diffusion_pytorch_model.safetensors" in fetched
    for part in parts.values():
        assert part.source == REPO and part.revision == "main" and part.commit == COMMIT
        assert part.path.is_dir()
    assert parts["t5_tokenizer"].path.name == "tokenizer_2"


def test_hub_repo_holding_the_component_at_its_root(tiny, tmp_path, monkeypatch):
    repo = tmp_path / "t5-alone"
    shutil.copytree(tiny / "text_encoder_2", repo)
    for name in (tiny / "tokenizer_2").iterdir():
        shutil.copy(name, repo)
    needed = {p.name for p in repo.iterdir() if p.is_file()}  # the model's and its tokenizer's own files
    (repo / "variants").mkdir()
    (repo / "variants" / "model.safetensors").write_bytes(b"a variant in a subfolder")
    (repo / "README.md").write_text("a model card")
    (repo / "flax_model.msgpack").write_bytes(b"weights for another framework")
    fake = FakeHub(tmp_path / "cache", {"someone/t5-encoder": repo})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    local_dir, subfolder = resolve_component("someone/t5-encoder", "text_encoder_2", encoder="T5")

    assert subfolder is None and (local_dir / "model.safetensors").is_file()
    # Exactly what loading the component needs: no variant in a subfolder, no card, no other framework's weights.
    assert fake.fetched() == needed


def _hub_error(status: int, error_code: str | None = None, path: str = f"/api/models/{REPO}/revision/main"):
    headers = {"X-Error-Code": error_code} if error_code else {}
    response = httpx2.Response(status, headers=headers, request=httpx2.Request("GET", "https://huggingface.co" + path))
    try:
        hf_raise_for_status(response)
    except Exception as exc:  # the exact class is what huggingface_hub decides
        return exc
    raise AssertionError(f"hf_raise_for_status did not raise for HTTP {status}")


def _raising(exc: BaseException):
    def snapshot_download(*args, **kwargs):
        raise exc

    return snapshot_download


@pytest.mark.parametrize(
    "status, error_code, reason",
    [
        (401, "GatedRepo", "gated"),
        (403, "GatedRepo", "gated"),
        (401, "RepoNotFound", "not found"),
        (403, None, "HTTP 403"),
    ],
)
def test_refused_download_names_encoder_repo_and_the_three_fixes(monkeypatch, status, error_code, reason):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(_hub_error(status, error_code)))
    with pytest.raises(AuthError) as info:
        resolve_component(REPO, "text_encoder_2", token=TOKEN, encoder="T5")
    message = str(info.value)
    assert message.startswith(f"T5: the Hugging Face Hub refused the download from {REPO}")
    assert reason in message
    assert "--hf-token-file" in message and "chmod 600" in message
    assert "HF_TOKEN" in message and "hf auth login" in message
    assert f"https://huggingface.co/{REPO}" in message  # where to accept the license
    assert "A token was sent" in message
    assert TOKEN not in message and TOKEN not in repr(info.value)


def test_refusal_wrapped_by_snapshot_download_is_recognized(monkeypatch):
    # snapshot_download reports some refusals as "not in the cache", with the HTTP error as the cause.
    wrapped = LocalEntryNotFoundError("cannot find the requested files in the local cache")
    wrapped.__cause__ = _hub_error(403)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(wrapped))
    with pytest.raises(AuthError, match=r"^VAE: .*HTTP 403.*No token was found"):
        resolve_encoders(ModelConfig(model_path=REPO))


def test_missing_revision_is_a_config_error(monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(_hub_error(404, "RevisionNotFound")))
    with pytest.raises(ConfigError, match="revision 'v9' does not exist in hub repo"):
        resolve_encoders(ModelConfig(model_path=REPO, revision="v9"))


def test_network_errors_propagate_unchanged(monkeypatch):
    error = httpx2.ConnectError("connection refused")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(error))
    with pytest.raises(httpx2.ConnectError) as info:
        resolve_component(REPO, "vae", encoder="VAE")
    assert info.value is error
    server_down = _hub_error(503)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(server_down))
    with pytest.raises(type(server_down)):
        resolve_component(REPO, "vae", encoder="VAE")


def test_offline_and_not_cached_names_the_encoder_and_the_three_fixes(monkeypatch, tmp_path):
    # huggingface_hub's own snapshot_download on an empty cache with HF_HUB_OFFLINE set (as this module runs).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(OfflineError) as info:
        resolve_encoders(ModelConfig(model_path=REPO))
    message = str(info.value)
    assert message.startswith(f"VAE: {REPO} is not in the Hugging Face cache ({tmp_path / 'empty-cache'})")
    assert "HF_HUB_OFFLINE is set" in message and "three ways" in message
    assert "--model-path DIR" in message  # 1. a local copy
    # 2. exactly the folders the Flux encoders need, never the transformer
    assert f"`hf download {REPO} --include 'vae/*' 'text_encoder/*' 'tokenizer/*' 'text_encoder_2/*' " \
           "'tokenizer_2/*' model_index.json`" in message
    assert "transformer" not in message
    assert "unset HF_HUB_OFFLINE" in message  # 3. go online
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_a_hub_vae_repo_without_model_index_is_told_by_its_config_and_loads(tiny, tmp_path, monkeypatch):
    # stabilityai/sd-vae-ft-mse holds config.json + weights at its root and no model_index.json.
    from diffprep.families import family_of_model
    from diffprep.families.sd_vae import load_sd_vae
    from diffprep.families.sd_vae_tiny import write_tiny_sd_vae

    vae = write_tiny_sd_vae(tmp_path / "sd-vae-ft-mse")
    (vae / "diffusion_pytorch_model.bin").write_bytes(b"the other framework's copy")
    fake = FakeHub(tmp_path / "cache", {"stabilityai/sd-vae-ft-mse": vae, REPO: tiny,
                                        "someone/flux-vae": tiny / "vae"})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    assert family_of_model("stabilityai/sd-vae-ft-mse", token=TOKEN).name == "sd-vae"
    assert fake.calls[-1]["allow"] == ["model_index.json", "config.json"] and fake.calls[-1]["token"] == TOKEN
    assert fake.fetched() == {"config.json"}  # detection reads the config alone, never the weights
    assert family_of_model(REPO).name == "flux"  # told by its model_index.json, as before
    assert family_of_model("someone/flux-vae").name == "flux"  # a 16-channel AutoencoderKL is not the SD VAE

    # The README's ImageNet-256 command plans as sd-vae latents with the hub id as --model-path.
    from diffprep import contract
    from diffprep.phases.fetch import fetch
    from test_sd_vae import sd_vae_settings, write_classes

    settings = sd_vae_settings(tmp_path / "out", write_classes(tmp_path / "train"), "stabilityai/sd-vae-ft-mse")
    assert fetch(settings)[0].encoding == contract.ENCODING_SD_VAE

    loaded = load_sd_vae("stabilityai/sd-vae-ft-mse", token=TOKEN)
    assert loaded.vae.config.latent_channels == 4 and fake.calls[-1]["token"] == TOKEN
    assert "diffusion_pytorch_model.bin" not in {Path(n).name for n in fake.fetched()}
