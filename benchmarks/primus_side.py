"""The ``primus`` side of ``benchmarks/cli.py``: AMD Primus's own ``primus data diffusion-encoded``, unmodified.

Primus is not on the package registry (``primus`` 0.0.1 there is another project), so the side runs a source
tree: ``--primus-checkout DIR`` (a checkout, ``DIR/primus/cli/main.py``), or ``--primus-git DIR`` (a bare mirror
whose ``HEAD:primus`` is exported to the scratch folder: only that folder, as a mirror may lack the blobs of
large files elsewhere). The child is diffprep's own interpreter with ``PYTHONPATH`` at the tree: nothing is
installed into the venv and nothing in Primus is patched.

How the settings map (Primus's flags, ``primus/cli/subcommands/data.py``):

- ``--model-path`` the tiny Flux set: Primus takes its ``vae``, ``text_encoder_2``/``tokenizer_2`` and
  ``text_encoder``/``tokenizer`` subfolders when the path's text contains "flux"
  (``EncodedDatasetPipeline._load_encoders``); a set elsewhere is reached through a link so named;
- ``--device`` cpu, or cuda where torch sees one (Primus's default is cuda, diffprep's auto);
- fp32, batch 8, shard size 64, 256 px, T5 512, center crop (Primus's default), ``--no-finalize``.

Primus decodes every image into memory before it encodes (``load_data_distributed``), which is why its
peak RSS grows with the number of images.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import torch

ENTRY = Path("primus") / "cli" / "main.py"
FIELDS = ("latents.pth", "prompt_embeds.pth", "pooled_prompt_embeds.pth")


def export_mirror(git_dir: Path, dest: Path) -> Path:
    """``HEAD:primus`` of the bare mirror ``git_dir`` as a tree under ``dest``; returns the tree's root."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "--format=tar", "HEAD", "primus"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive of {git_dir} HEAD:primus failed: {archive.stderr.decode(errors='replace')}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def checkout(tree: str | None, git_dir: str | None, scratch: Path) -> Path | None:
    """The Primus tree to run (None: no side), checked to hold the CLI's entry."""
    if tree and git_dir:
        raise SystemExit("give --primus-checkout or --primus-git, not both")
    if not (tree or git_dir):
        return None
    root = Path(tree).expanduser().resolve() if tree else export_mirror(Path(git_dir).expanduser(),
                                                                      scratch / "primus-tree")
    if not (root / ENTRY).is_file():
        raise SystemExit(f"{root} is not a Primus source tree: no {ENTRY}")
    return root


def flux_named(model: Path, scratch: Path) -> Path:
    """``model`` as a path Primus reads as a Flux set (its text contains "flux"), through a link if need be."""
    if "flux" in str(model).lower():
        return model
    link = scratch / "primus-tiny-flux"
    if not link.exists():
        link.symlink_to(model.resolve(), target_is_directory=True)
    return link


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def command(python: str, tree: Path, source: Path, model: Path, out: Path, samples: int, settings: dict,
            latent_mode: str = "presampled") -> list[str]:
    """Primus's CLI on diffprep's settings; ``latent_mode`` "resample" stores the posterior mean as latents."""
    s = settings
    return [python, str(tree / ENTRY), "data", "diffusion-encoded", "--source-type", "directory",
            "--input-dir", str(source), "--output-dir", str(out), "--model-path", str(model),
            "--precision", s["precision"], "--device", device(), "--batch-size", str(s["batch_size"]),
            "--shard-size", str(s["shard_size"]), "--image-size", str(s["image_size"]),
            "--t5-max-length", str(s["t5_max_length"]), "--max-samples", str(samples),
            "--vae-latent-mode", latent_mode, "--no-finalize"]


def env(base: dict[str, str], tree: Path) -> dict[str, str]:
    """``base`` with only ``tree`` on PYTHONPATH (diffprep's repository is not on it)."""
    return {**base, "PYTHONPATH": str(tree)}


def read_shards(out: Path) -> list[dict[str, torch.Tensor]]:
    """Every sample's tensors, in shard and member order (both tools write samples in source order)."""
    samples: list[dict[str, torch.Tensor]] = []
    for shard in sorted(out.glob("*.tar")):
        keys: dict[str, dict[str, torch.Tensor]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext in FIELDS:
                    data = tar.extractfile(member).read()
                    keys.setdefault(key, {})[ext] = torch.load(io.BytesIO(data), weights_only=True)
        samples.extend(keys[k] for k in sorted(keys))
    return samples


def count_samples(out: Path) -> int:
    """Samples in ``out``'s shards: the keys that have latents (member names only, nothing loaded)."""
    total = 0
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            total += sum(1 for name in tar.getnames() if name.endswith(".latents.pth"))
    return total


def differences(a: Path, b: Path, fields: tuple[str, ...] = FIELDS) -> dict:
    """Samples in each output, and per field the largest |a - b| over the samples they share (None: shapes
    differ)."""
    left, right = read_shards(a), read_shards(b)
    worst: dict[str, float | None] = {}
    for x, y in zip(left, right):
        for field in fields:
            if field not in worst or worst[field] is not None:
                if x[field].shape != y[field].shape:
                    worst[field] = None
                else:
                    delta = float((x[field].double() - y[field].double()).abs().max())
                    worst[field] = max(worst.get(field) or 0.0, delta)
    return {"samples": (len(left), len(right)), "max_abs": worst}


def describe(diff: dict) -> str:
    parts = [f"{field.removesuffix('.pth')} {'shape differs' if v is None else f'{v:.2g}'}"
             for field, v in diff["max_abs"].items()]
    return f"{diff['samples'][0]} / {diff['samples'][1]} samples; max |diffprep - Primus|: " + ", ".join(parts)


def tree_revision(tree: Path, git_dir: str | None) -> str:
    """A short description of what runs: the mirror's HEAD commit, or the checkout's path."""
    if git_dir:
        rev = subprocess.run(["git", "--git-dir", os.path.expanduser(git_dir), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=False).stdout.strip()
        return f"{git_dir} HEAD {rev or '?'}, exported to {tree}"
    return str(tree)
