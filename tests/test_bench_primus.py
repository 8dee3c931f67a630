"""benchmarks/primus_side.py: how the Primus side finds its tree, names the model, builds its command and reads
the shards both tools write. Primus itself is never run here (it is not a dependency)."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import primus_side  # noqa: E402

SETTINGS = {"image_size": 256, "precision": "fp32", "batch_size": 8, "shard_size": 64, "t5_max_length": 512}


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_a_bare_mirror_is_exported_to_a_tree_with_the_cli_entry(tmp_path):
    work = tmp_path / "work"
    (work / "primus" / "cli").mkdir(parents=True)
    (work / "primus" / "cli" / "main.py").write_text("print('primus')\n")
    (work / "elsewhere.txt").write_text("not exported\n")
    git("init", "-q", cwd=work)
    git("add", ".", cwd=work)
    git("commit", "-qm", "c", cwd=work)
    git("clone", "-q", "--bare", str(work), str(tmp_path / "mirror.git"), cwd=tmp_path)

    tree = primus_side.checkout(None, str(tmp_path / "mirror.git"), tmp_path / "scratch")
    assert (tree / "primus" / "cli" / "main.py").read_text() == "print('primus')\n"
    assert not (tree / "elsewhere.txt").exists()
    assert primus_side.checkout(str(tree), None, tmp_path) == tree.resolve()
    assert primus_side.checkout(None, None, tmp_path) is None


def test_a_tree_without_the_entry_or_both_flags_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a Primus source tree"):
        primus_side.checkout(str(tmp_path), None, tmp_path)
    with pytest.raises(SystemExit, match="not both"):
        primus_side.checkout(str(tmp_path), str(tmp_path), tmp_path)


def test_the_model_is_named_so_primus_reads_its_flux_subfolders(tmp_path):
    named = tmp_path / "tiny-flux"
    named.mkdir()
    assert primus_side.flux_named(named, tmp_path) == named
    plain = tmp_path / "tiny-set"
    (plain / "vae").mkdir(parents=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    link = primus_side.flux_named(plain, scratch)
    assert link.parent == scratch and "flux" in link.name and (link / "vae").is_dir()
    assert primus_side.flux_named(plain, scratch) == link  # a second run reuses the link


def test_the_command_carries_the_diffprep_side_settings(tmp_path):
    cmd = primus_side.command("py", tmp_path, Path("/src"), Path("/m/tiny-flux"), Path("/out"), 1024, SETTINGS)
    assert cmd[:4] == ["py", str(tmp_path / "primus" / "cli" / "main.py"), "data", "diffusion-encoded"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags["--input-dir"] == "/src" and flags["--model-path"] == "/m/tiny-flux"
    assert (flags["--precision"], flags["--batch-size"], flags["--shard-size"], flags["--image-size"],
            flags["--t5-max-length"], flags["--max-samples"]) == ("fp32", "8", "64", "256", "512", "1024")
    assert flags["--device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cmd[-1] == "--no-finalize" and flags["--vae-latent-mode"] == "presampled"
    assert primus_side.env({"PYTHONPATH": "/diffprep", "A": "1"}, tmp_path) == {"PYTHONPATH": str(tmp_path), "A": "1"}


def write_shard(path: Path, samples: list[dict[str, torch.Tensor]], extra: bool) -> None:
    with tarfile.open(path, "w") as tar:
        for i, fields in enumerate(samples):
            for name, tensor in fields.items():
                buffer = io.BytesIO()
                torch.save(tensor, buffer)
                info = tarfile.TarInfo(f"000000_{i:06d}.{name}")
                info.size = len(buffer.getvalue())
                tar.addfile(info, io.BytesIO(buffer.getvalue()))
            if extra:
                info = tarfile.TarInfo(f"000000_{i:06d}.caption.txt")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"a"))


def test_the_outputs_are_counted_and_compared_field_by_field(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [{"latents.pth": torch.randn(16, 4, 4, generator=g), "prompt_embeds.pth": torch.randn(8, 4, generator=g),
                "pooled_prompt_embeds.pth": torch.randn(4, generator=g)} for _ in range(3)]
    other = [dict(s) for s in samples]
    other[1]["latents.pth"] = other[1]["latents.pth"] + 0.25
    other[2]["pooled_prompt_embeds.pth"] = torch.zeros(5)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_shard(tmp_path / "a" / "000000.tar", samples, extra=True)
    write_shard(tmp_path / "b" / "000000.tar", other, extra=False)

    assert primus_side.count_samples(tmp_path / "a") == primus_side.count_samples(tmp_path / "b") == 3
    diff = primus_side.differences(tmp_path / "a", tmp_path / "b")
    assert diff["samples"] == (3, 3)
    assert diff["max_abs"]["latents.pth"] == pytest.approx(0.25, abs=1e-6)
    assert diff["max_abs"]["prompt_embeds.pth"] == 0.0
    assert diff["max_abs"]["pooled_prompt_embeds.pth"] is None
    assert "pooled_prompt_embeds shape differs" in primus_side.describe(diff)
