"""Find the encoder folders: local folders as they are, hub repos downloaded in part.

A model is given as a local folder or a Hugging Face Hub repo id, in the
FLUX.1-dev layout (vae/, text_encoder/, tokenizer/, text_encoder_2/,
tokenizer_2/) or, for the per-encoder overrides, as the component itself (a
folder whose config.json is the model's own). From a hub repo only the
subfolders an encoder needs are downloaded, never the transformer.

Authentication: a token file (``--hf-token-file``, readable by its owner
only), else ``HF_TOKEN``, else the login cached by ``hf auth login``. A refused
download becomes an :class:`~diffprep.errors.AuthError` that names the encoder,
the repo and those three ways; the token itself never appears in a message.
A model that is not in the cache while the hub cannot be reached (offline, or
``HF_HUB_OFFLINE`` set) becomes an :class:`~diffprep.errors.OfflineError`
naming the encoder and the three ways out: a local copy (``--model-path``),
``hf download`` of exactly the folders needed, or going online. Other network
errors are left as they are, for the caller to retry.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from diffprep.config import ModelConfig
from diffprep.errors import AuthError, ConfigError, OfflineError

HF_TOKEN_ENV = "HF_TOKEN"

# "name" or "namespace/name", as the hub accepts them; anything else is taken as a local path.
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# Files that hold weights; everything else in a component folder (configs, tokenizer files) is hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")

# Root files of a hub repo that holds a component itself (e.g. a T5 encoder saved alone).
_COMPONENT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


@dataclass(frozen=True)
class Part:
    """One folder an encoder needs: where it sits in its family's layout and how to recognize it."""

    name: str  # key used throughout diffprep: vae, clip_text, clip_tokenizer, t5_text, t5_tokenizer
    encoder: str  # how messages call the encoder: VAE, CLIP, T5
    override: str  # the ModelConfig field that replaces model_path for this encoder
    subfolder: str  # folder in the family's layout (FLUX.1-dev: vae, text_encoder, ...)
    markers: tuple[str, ...]  # any of these files marks a folder holding this part


@dataclass(frozen=True)
class ResolvedPart:
    """Where one part was found on disk, and where it came from."""

    name: str
    source: str  # the hub repo id, or the local folder as an absolute path
    revision: str | None  # the hub revision asked for (None: the default branch, or a local folder)
    commit: str | None  # the hub commit the files come from (None for a local folder)
    local_dir: Path  # the local folder (a hub snapshot or the user's folder)
    subfolder: str | None  # None when local_dir is the component itself

    @property
    def path(self) -> Path:
        """The folder to pass to ``from_pretrained``."""
        return self.local_dir / self.subfolder if self.subfolder else self.local_dir

    def identity(self) -> dict[str, Any]:
        """JSON-able identity for the config fingerprint.

        Config and tokenizer files are hashed; weight files are named with their
        sizes only (hashing multi-GB files on every run is too slow). The hub
        commit pins the weights; for a local folder its path stands in for them.
        """
        files: dict[str, str] = {}
        weights: dict[str, int] = {}
        for entry in sorted(self.path.iterdir()):
            if not entry.is_file():
                continue
            if entry.name.endswith(_WEIGHT_SUFFIXES):
                weights[entry.name] = entry.stat().st_size
            else:
                files[entry.name] = hashlib.sha256(entry.read_bytes()).hexdigest()
        return {
            "source": self.source,
            "revision": self.revision,
            "commit": self.commit,
            "subfolder": self.subfolder,
            "files_sha256": files,
            "weight_bytes": weights,
        }


def resolve_token(token_file: str | os.PathLike | None) -> str | None:
    """The Hugging Face token to use: from ``token_file``, else ``HF_TOKEN``, else None.

    None lets huggingface_hub fall back to the login cached by ``hf auth login``.
    A token file that group or others can access is refused, with the
    ``chmod`` that fixes it.
    """
    if token_file is None:
        return os.environ.get(HF_TOKEN_ENV, "").strip() or None
    path = Path(token_file).expanduser()
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"auth.hf_token_file: {path} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"auth.hf_token_file: {path} is not a regular file")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"auth.hf_token_file: {path} can be accessed by other users (mode {stat.S_IMODE(info.st_mode):03o}); "
            f"a token file must be readable by its owner only. Run `chmod 600 {shlex.quote(str(path))}` and retry."
        )
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ConfigError(f"auth.hf_token_file: {path} is empty; write the token (hf_...) into it")
    if any(char.isspace() for char in token):
        raise ConfigError(f"auth.hf_token_file: {path} holds more than one word; it must hold the token alone")
    return token


def resolve_component(
    path_or_repo: str,
    subfolder: str | None,
    *,
    revision: str | None = None,
    token: str | None = None,
    encoder: str = "model",
) -> tuple[Path, str | None]:
    """Return ``(local_dir, subfolder)`` holding one component, downloading it if needed.

    ``path_or_repo`` is a local folder or a hub repo id. A folder (or repo)
    with ``subfolder`` in it is in the full layout: ``(root, subfolder)``.
    One without it but with a config.json at its root is the component
    itself: ``(root, None)``. ``encoder`` (VAE, CLIP, T5) names the encoder in
    error messages.
    """
    local = Path(path_or_repo).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ConfigError(
                f"{encoder}: revision {revision!r} was given but {path_or_repo} is a local folder; "
                "a revision applies to hub repos only. Remove model.revision (--revision)."
            )
        return _local_component(local.resolve(), subfolder, encoder)
    if local.exists():
        raise ConfigError(f"{encoder}: {path_or_repo} is a file; expected a folder or a Hugging Face Hub repo id")
    if not _REPO_ID_RE.match(path_or_repo):
        raise ConfigError(
            f"{encoder}: {path_or_repo} is not an existing folder, nor a hub repo id (namespace/name); check the path"
        )
    return _hub_component(path_or_repo, subfolder, revision=revision, token=token, encoder=encoder)


def hub_root_files(repo_id: str, names: Sequence[str], *, revision: str | None = None, token: str | None = None,
                   encoder: str = "model") -> Path:
    """The snapshot folder holding those of ``names`` (root files: ``model_index.json``, ``config.json``) that hub
    repo ``repo_id`` has, downloaded alone (or read from the cache) through the same download as the encoders."""
    return _download(repo_id, list(names), ["*/*"], revision=revision, token=token, encoder=encoder)


def resolve_parts(model: ModelConfig, parts: Sequence[Part], layout: str, *, token: str | None = None
                  ) -> dict[str, ResolvedPart]:
    """Resolve (and download if needed) every part of a family's encoders, keyed by part name; ``layout``
    names the family's folder layout in messages (``FLUX.1-dev``).

    Each encoder comes from its override (``vae_path``, ``clip_path``,
    ``t5_path``) when set, else from ``model_path`` at ``model.revision``.
    The fetch phase calls this once so later loads find everything cached.
    """
    resolved: dict[str, ResolvedPart] = {}
    for part in parts:
        override = getattr(model, part.override)
        source = override or model.model_path
        # model.revision is the revision of model_path; an override is used at its default branch.
        revision = None if override else model.revision
        try:
            local_dir, subfolder = resolve_component(
                source, part.subfolder, revision=revision, token=token, encoder=part.encoder
            )
        except OfflineError as exc:  # name every folder this model needs from that repo, not this one's alone
            from_repo = [p.subfolder for p in parts if (getattr(model, p.override) or model.model_path) == source]
            raise OfflineError(offline_message(part.encoder, source, revision, from_repo), encoder=part.encoder,
                               repo_id=source, revision=revision) from exc.__cause__
        folder = local_dir / subfolder if subfolder else local_dir
        if not any((folder / marker).is_file() for marker in part.markers):
            field = part.override if override else "model_path"
            raise ConfigError(
                f"{part.encoder}: {folder} has no {' or '.join(part.markers)}, so it does not hold the "
                f"{part.subfolder} part. Point model.{field} at a folder in the {layout} layout (with "
                f"{part.subfolder}/) or at one that holds the model and its tokenizer together. "
                f"It holds: {_listing(folder)}"
            )
        is_local = Path(source).expanduser().is_dir()
        resolved[part.name] = ResolvedPart(
            name=part.name,
            source=str(local_dir) if is_local else source,
            revision=revision,
            commit=None if is_local else _snapshot_commit(local_dir),
            local_dir=local_dir,
            subfolder=subfolder,
        )
    return resolved


def _local_component(root: Path, subfolder: str | None, encoder: str) -> tuple[Path, str | None]:
    if subfolder and (root / subfolder).is_dir():
        return root, subfolder
    if (root / "config.json").is_file():
        return root, None
    wanted = f"a {subfolder}/ folder (FLUX.1-dev layout) nor " if subfolder else ""
    raise ConfigError(
        f"{encoder}: {root} has neither {wanted}a config.json (the component itself). It holds: {_listing(root)}"
    )


def _hub_component(
    repo_id: str, subfolder: str | None, *, revision: str | None, token: str | None, encoder: str
) -> tuple[Path, str | None]:
    if subfolder:
        # The root config.json is fetched too: it tells a repo holding the component itself.
        patterns = [f"{subfolder}/*", "model_index.json", "config.json"]
        snapshot = _download(repo_id, patterns, None, revision=revision, token=token, encoder=encoder)
        if (snapshot / subfolder).is_dir():
            return snapshot, subfolder
        if not (snapshot / "config.json").is_file():
            raise ConfigError(
                f"{encoder}: hub repo {repo_id} has no {subfolder}/ folder (FLUX.1-dev layout) and no config.json "
                "at its root (the component itself); check the repo id"
            )
    # The component sits at the repo root: take the root files only (no variants in subfolders).
    snapshot = _download(repo_id, _COMPONENT_PATTERNS, ["*/*"], revision=revision, token=token, encoder=encoder)
    return snapshot, None


def _download(
    repo_id: str,
    allow_patterns: list[str],
    ignore_patterns: list[str] | None,
    *,
    revision: str | None,
    token: str | None,
    encoder: str,
) -> Path:
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
        )
    except RevisionNotFoundError:
        raise ConfigError(
            f"{encoder}: revision {revision!r} does not exist in hub repo {repo_id}; check model.revision (--revision)"
        ) from None
    except (HfHubHTTPError, huggingface_hub.errors.LocalEntryNotFoundError) as exc:
        refusal = _refusal(exc)
        if refusal is not None:
            raise AuthError(_auth_message(encoder, repo_id, refusal, token)) from exc
        if isinstance(exc, huggingface_hub.errors.LocalEntryNotFoundError):
            # snapshot_download's way of saying: not in the cache, and the hub was not asked or did not answer.
            folders = [pattern.removesuffix("/*") for pattern in allow_patterns if pattern.endswith("/*")]
            raise OfflineError(offline_message(encoder, repo_id, revision, folders), encoder=encoder,
                               repo_id=repo_id, revision=revision) from exc
        raise
    return Path(folder)


def offline_message(encoder: str, repo_id: str, revision: str | None, folders: Sequence[str]) -> str:
    """What to do when ``repo_id`` (its ``folders``) is not cached and the hub cannot be reached."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set, so the hub is not asked"
        online = "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) on a machine that reaches huggingface.co"
    else:
        why = "the hub could not be reached from this machine"
        online = "run again where huggingface.co can be reached (check the network or proxy settings)"
    includes = " ".join(shlex.quote(f"{folder}/*") for folder in folders)
    command = f"hf download {shlex.quote(repo_id)}" + (f" --revision {shlex.quote(revision)}" if revision else "")
    command += f" --include {includes} model_index.json" if folders else ""
    return (
        f"{encoder}: {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. "
        "Fix it in one of three ways:\n"
        f"  1. --model-path DIR (model.model_path; per encoder --vae-path / --t5-path / --clip-path): a local copy "
        "of the model's folders\n"
        f"  2. download it into the cache once: `{command}` (huggingface-cli download in older huggingface_hub; "
        "the same HF_HOME as this run)\n"
        f"  3. go online: {online}"
    )


def _refusal(exc: BaseException) -> str | None:
    """Why the hub refused access, or None when ``exc`` is not a refusal.

    snapshot_download wraps some refusals (a 403 on the repo listing) in a
    LocalEntryNotFoundError, so the cause is looked at too.
    """
    for error in (exc, exc.__cause__):
        if isinstance(error, GatedRepoError):
            return "the repo is gated"
        if isinstance(error, RepositoryNotFoundError):
            return "repo not found, or private or gated and not accessible with the credentials sent"
        if isinstance(error, HfHubHTTPError) and error.response is not None:
            if error.response.status_code in (401, 403):
                return f"HTTP {error.response.status_code}"
    return None


def _auth_message(encoder: str, repo_id: str, refusal: str, token: str | None) -> str:
    if token is not None:
        credentials = "A token was sent but it does not give access to this repo."
    elif huggingface_hub.get_token() is not None:
        credentials = "The token from the Hugging Face login cache was sent but it does not give access to this repo."
    else:
        credentials = "No token was found."
    return (
        f"{encoder}: the Hugging Face Hub refused the download from {repo_id} ({refusal}). {credentials}\n"
        f"If the repo is gated, accept its license at https://huggingface.co/{repo_id} with your account, "
        "then authenticate in one of three ways:\n"
        "  1. --hf-token-file PATH (auth.hf_token_file): a file holding the token, readable by you only "
        "(chmod 600 PATH)\n"
        f"  2. the {HF_TOKEN_ENV} environment variable\n"
        "  3. `hf auth login` (caches the token for this user)\n"
        "Or set model.model_path / vae_path / t5_path / clip_path to local folders."
    )


def _snapshot_commit(local_dir: Path) -> str | None:
    # The hub cache keeps each download under .../snapshots/<commit hash>/.
    return local_dir.name if local_dir.parent.name == "snapshots" else None


def _listing(folder: Path) -> str:
    try:
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir())
    except OSError as exc:
        return f"(cannot list: {exc.strerror})"
    if not names:
        return "nothing"
    shown = ", ".join(names[:20])
    return shown + (f", ... ({len(names)} entries)" if len(names) > 20 else "")
