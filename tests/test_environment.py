"""The environment `make setup` builds works for every program in it, not only for diffprep.

Each import runs in a fresh interpreter that never imports diffprep: what a user's training script, a
trainer's loader or a notebook in this venv does first. The failure these guard against: ltx-core pulls
torchaudio, PyPI's torchaudio is a CUDA 13 build, and beside a CPU torch it fails to load, taking
diffusers and transformers with it (both import torchaudio once it is installed).
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from diffprep.families.ltx2_torchaudio import NO_EXTENSION_LABEL, build_without_extension

FRESH_IMPORTS = {
    "diffusers": "from diffusers import AutoencoderKL",
    "transformers": "from transformers import T5EncoderModel",
    "megatron-energon": "import megatron.energon",
    # The part of ltx-core that imports torchaudio (its log-mel step), and what it builds models with.
    "ltx-core": "import ltx_core.model.audio_vae, ltx_core.model.video_vae, ltx_core.loader",
    # Shot detection (--split-scenes): OpenCV's headless build loads with no GUI library on the machine.
    "scenedetect-headless": "import cv2, scenedetect.backends.pyav, scenedetect.detectors",
}


def test_no_gui_opencv_is_installed():
    """scenedetect-headless brings opencv-python-headless; the GUI build (libGL, X11) must not come with anything."""
    for gui in ("opencv-python", "opencv-contrib-python"):
        with pytest.raises(PackageNotFoundError):
            version(gui)


def run_fresh(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter, started outside the checkout (so only what is installed is importable)."""
    import os

    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.mark.parametrize("distribution", sorted(FRESH_IMPORTS))
def test_libraries_import_in_a_fresh_process_without_diffprep(distribution, tmp_path):
    try:
        version(distribution)
    except PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed here (ltx-core comes with the ltx2 and test extras)")
    code = f"import sys\n{FRESH_IMPORTS[distribution]}\nassert 'diffprep' not in sys.modules, 'diffprep was imported'"
    result = run_fresh(code, tmp_path)
    assert result.returncode == 0, f"`{FRESH_IMPORTS[distribution]}` failed in a fresh process:\n{result.stderr}"


def test_the_installed_torchaudio_loads_beside_torch(tmp_path):
    code = ("import torch, torchaudio, torchaudio.transforms as T\n"
            "mel = T.MelSpectrogram(sample_rate=16000, n_fft=1024, hop_length=160, n_mels=64)(torch.ones(1, 16000))\n"
            "assert mel.shape == (1, 64, 101), mel.shape\n"
            "assert torchaudio.functional.resample(torch.ones(1, 44100), 44100, 16000).shape == (1, 16000)")
    result = run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr
    if version("torchaudio").endswith(f"+{NO_EXTENSION_LABEL}"):
        import torchaudio

        libraries = sorted(p.name for p in (Path(torchaudio.__file__).parent / "lib").glob("*.so"))
        assert libraries == [] and not torchaudio._extension._IS_TORCHAUDIO_EXT_AVAILABLE


def test_pip_check_finds_no_broken_requirement():
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


BROKEN_TORCHAUDIO = '''raise OSError("Could not load this library: /venv/torchaudio/lib/_torchaudio.so")\n'''


def test_a_torchaudio_that_does_not_load_stops_ltx2_loading_with_the_fix(tmp_path):
    """A torchaudio that fails as PyPI's CUDA build fails beside a CPU torch: LTX-2 loading says what to run."""
    shadow = tmp_path / "shadow" / "torchaudio"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(BROKEN_TORCHAUDIO)
    code = "\n".join([
        "import diffprep.cli, diffprep.families.ltx2 as ltx2",  # importing diffprep and the family is untouched
        "from diffprep.errors import DiffprepError",
        "for call in (lambda: ltx2.Ltx2Encoders.load('/nowhere/ltx.safetensors'),",
        "             lambda: ltx2.describe_ltx2('/nowhere/ltx.safetensors')):",
        "    try:",
        "        call()",
        "    except DiffprepError as error:",
        "        print(error)",
        "    else:",
        "        raise SystemExit('no error')",
        # The tiny LTX-2 set needs ltx-core's audio code too: the same message, as the command's error.
        "import contextlib, io",
        "err = io.StringIO()",
        "with contextlib.redirect_stderr(err):",
        "    code = diffprep.cli.main(['tiny-model', 'tiny-ltx2', '--family', 'ltx2'])",
        "assert code == 2 and 'does not import beside torch 2.' in err.getvalue(), (code, err.getvalue())",
    ])
    result = run_fresh(code, tmp_path, PYTHONPATH=str(shadow.parent))
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("See docs/guides/ltx2.md")[:2]
    assert "does not import beside torch 2." in first and "OSError: Could not load this library" in first
    assert f"{sys.executable} -m diffprep.families.ltx2_torchaudio\n" in first
    assert "ltx.safetensors" not in result.stdout  # the torchaudio check comes before the checkpoint is read
    assert "does not import beside torch 2." in second


def fake_torchaudio_wheel(folder: Path) -> Path:
    """A wheel laid out as PyPI's torchaudio 2.11.1 (Python files, compiled libraries, dist-info)."""
    wheel = folder / "torchaudio-2.11.1-py3-none-manylinux_2_28_x86_64.whl"
    info = "torchaudio-2.11.1.dist-info"
    members = {
        "torchaudio/__init__.py": b"from . import lib\n",
        "torchaudio/lib/__init__.py": b"",
        "torchaudio/lib/_torchaudio.so": b"\x7fELF compiled",
        "torchaudio/lib/libtorchaudio.so": b"\x7fELF compiled",
        f"{info}/METADATA": b"Metadata-Version: 2.4\nName: torchaudio\nVersion: 2.11.1\nRequires-Dist: torch>=2.11\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools\nRoot-Is-Purelib: false\n"
                         b"Tag: py3-none-linux_x86_64\n",
        f"{info}/top_level.txt": b"torchaudio\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in members) + f"{info}/RECORD,,\n")
    return wheel


def test_the_build_without_extension_is_a_valid_pure_wheel_without_libraries(tmp_path):
    built = build_without_extension(fake_torchaudio_wheel(tmp_path), tmp_path / "out")
    assert built.name == "torchaudio-2.11.1+noext-py3-none-any.whl"
    info = "torchaudio-2.11.1+noext.dist-info"
    with zipfile.ZipFile(built) as archive:
        names = set(archive.namelist())
        assert names == {"torchaudio/__init__.py", "torchaudio/lib/__init__.py", f"{info}/METADATA",
                         f"{info}/WHEEL", f"{info}/top_level.txt", f"{info}/RECORD"}
        assert "Version: 2.11.1+noext\n" in archive.read(f"{info}/METADATA").decode()
        wheel_file = archive.read(f"{info}/WHEEL").decode()
        assert "Root-Is-Purelib: true\n" in wheel_file and wheel_file.endswith("Tag: py3-none-any\n")
        for line in archive.read(f"{info}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = archive.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={expected}", len(data)), name
    assert build_without_extension(fake_torchaudio_wheel(tmp_path), tmp_path / "again").read_bytes() \
        == built.read_bytes()

    # pip installs it as it is, offline: the hashes and the metadata are what an installer checks.
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
                             "--target", str(target), str(built)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (target / "torchaudio" / "lib").glob("*.*")) == ["__init__.py"]
    assert (target / info / "METADATA").is_file()
