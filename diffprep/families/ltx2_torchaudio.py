"""torchaudio for the LTX-2 family: the check LTX-2 loading runs, and the install of a build that loads beside torch.

ltx-core imports torchaudio for its log-mel step (``AudioProcessor``:
``transforms.MelSpectrogram`` and ``functional.resample``, both plain torch
code). torchaudio 2.11 is built against torch's stable ABI and loads with torch
2.11 and every later release, but only beside a torch of its own kind: PyPI's
torchaudio 2.11.1 wheel is a CUDA 13 build (its libraries link
``libcudart.so.13`` and ``libtorch_cuda.so``), which matches PyPI's own torch
and nothing else. Beside a CPU torch (or a CUDA 12 one), ``import torchaudio``
raises ``OSError``, and from then on so do transformers (``audio_utils``) and
diffusers (``loaders.single_file_model``) in every process of that
environment, whatever it runs. So the right torchaudio goes in before ltx-core
does (the Makefile; docs/guides/ltx2.md, "Install the LTX-2 extra"), never after.

Its compiled extension holds forced alignment, the RNN-T loss, the CUDA CTC
decoder and faster loops for ``lfilter`` and ``overdrive``; nothing LTX-2 runs
uses them. Without the library files torchaudio imports in its own
no-extension state (``torchaudio._extension`` loads a file only if it is
there), where those functions refuse or take their Python loops. Where no
full build for the installed torch is reachable (a CPU torch with only PyPI,
as on CI), ``python -m diffprep.families.ltx2_torchaudio`` installs PyPI's
torchaudio and, if it does not load, the same release rebuilt without its
library files (version ``2.11.1+noext``).

Importing this module imports neither torch nor torchaudio (nor any of diffprep
but its errors): the Makefile runs it from the checkout before the project is
installed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from diffprep.errors import DiffprepError

# The last torchaudio release; 2.11 loads with every torch from 2.11 on.
TORCHAUDIO_RELEASE = "2.11.1"
# The local version label of the build without compiled libraries.
NO_EXTENSION_LABEL = "noext"
LIBRARY_DIR = "torchaudio/lib/"
IMPORT_CHECK = "import torchaudio"


class TorchaudioMismatchError(DiffprepError):
    """torchaudio does not import beside this torch; the message names the command that fixes it."""


def require_torchaudio() -> None:
    """Raise :class:`TorchaudioMismatchError` unless torchaudio imports (LTX-2 loading runs this first)."""
    try:
        import torchaudio  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        raise TorchaudioMismatchError(mismatch_message(error)) from error


def mismatch_message(error: BaseException) -> str:
    """What failed, for which torch, and the exact commands that install a torchaudio that loads."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        installed = f"torchaudio {version('torchaudio')}"
    except PackageNotFoundError:
        installed = "no torchaudio"
    what = f"{type(error).__name__}: {error}"
    if isinstance(error.__cause__, OSError):
        what += f" ({error.__cause__})"
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
        index = "cu" + torch.version.cuda.replace(".", "")
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
        index = "rocm" + ".".join(torch.version.hip.split(".")[:2])
    else:
        build, index = "CPU", "cpu"
    full = (
        f"{sys.executable} -m pip install --force-reinstall --no-deps torchaudio=={TORCHAUDIO_RELEASE}"
        if torch.version.cuda and torch.version.cuda.split(".")[0] == "13"
        else f"{sys.executable} -m pip install --force-reinstall --no-deps torchaudio "
        f"--index-url https://download.pytorch.org/whl/{index}"
    )
    return (
        f"the LTX-2 family needs torchaudio (ltx-core's log-mel step), and {installed} does not import beside "
        f"torch {torch.__version__} ({build} build): {what}. Install a torchaudio that loads beside this torch:\n"
        f"    {sys.executable} -m diffprep.families.ltx2_torchaudio\n"
        f"(PyPI's torchaudio {TORCHAUDIO_RELEASE} where it loads, else that release without its compiled extension, "
        f"which LTX-2 does not use), or the full {build} build of torchaudio:\n"
        f"    {full}\n"
        "Until then diffusers and transformers fail to import in this environment too (both import torchaudio "
        "once it is installed). See docs/guides/ltx2.md, \"Install the LTX-2 extra\"."
    )


def build_without_extension(wheel: Path, out_dir: Path) -> Path:
    """Write ``wheel`` (a torchaudio wheel) again without its compiled libraries, as a pure-Python wheel.

    Everything under ``torchaudio/lib/`` but its ``__init__.py`` is left out; the
    version gains the local label ``+noext`` (the dist-info folder is renamed to
    match), the tag becomes ``py3-none-any`` and ``RECORD`` is written anew with
    every file's hash. Returns the new wheel's path.
    """
    wheel = Path(wheel)
    match = re.fullmatch(r"torchaudio-([^-]+)-.+\.whl", wheel.name)
    if match is None:
        raise ValueError(f"{wheel.name} is not a torchaudio wheel (torchaudio-VERSION-TAGS.whl)")
    old_version = match.group(1)
    new_version = f"{old_version.split('+')[0]}+{NO_EXTENSION_LABEL}"
    old_info, new_info = f"torchaudio-{old_version}.dist-info/", f"torchaudio-{new_version}.dist-info/"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"torchaudio-{new_version}-py3-none-any.whl"
    records: list[str] = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dest:
        for item in source.infolist():
            name = item.filename
            if name.endswith("/") or name == old_info + "RECORD":
                continue
            if name.startswith(LIBRARY_DIR) and name != LIBRARY_DIR + "__init__.py":
                continue
            data = source.read(item)
            if name.startswith(old_info):
                name = new_info + name[len(old_info):]
                if name == new_info + "METADATA":
                    data = re.sub(rb"(?m)^Version: .*$", f"Version: {new_version}".encode(), data, count=1)
                elif name == new_info + "WHEEL":
                    text = data.decode()
                    text = re.sub(r"(?m)^Root-Is-Purelib: .*$", "Root-Is-Purelib: true", text)
                    text = re.sub(r"(?m)^Tag: .*\n?", "", text).rstrip("\n") + "\nTag: py3-none-any\n"
                    data = text.encode()
            member = zipfile.ZipInfo(name, date_time=item.date_time)  # the source's times: the same bytes each run
            member.external_attr, member.compress_type = item.external_attr, zipfile.ZIP_DEFLATED
            dest.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{name},sha256={digest},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        dest.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    return target


def _imports(python: str, statement: str = IMPORT_CHECK) -> bool:
    return subprocess.run([python, "-c", statement], capture_output=True).returncode == 0


def install(python: str = sys.executable) -> str:
    """Leave a torchaudio that imports beside ``python``'s torch and say which one (see the module docstring)."""
    pip = [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet"]
    if not _imports(python, "import torch"):
        raise SystemExit(f"torch does not import in {python}: install torch first (the build for this machine)")
    if _imports(python):
        return "torchaudio already imports beside this torch: kept"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                        "-d", tmp, f"torchaudio=={TORCHAUDIO_RELEASE}"], check=True)
        (wheel,) = Path(tmp).glob("torchaudio-*.whl")
        subprocess.run([*pip, str(wheel)], check=True)
        if _imports(python):
            return f"installed PyPI's torchaudio {TORCHAUDIO_RELEASE}: it loads beside this torch"
        subprocess.run([*pip, str(build_without_extension(wheel, Path(tmp) / "noext"))], check=True)
    if not _imports(python):
        raise SystemExit(f"torchaudio {TORCHAUDIO_RELEASE}+{NO_EXTENSION_LABEL} does not import either: "
                         f"run `{python} -c '{IMPORT_CHECK}'` to see why")
    return (f"installed torchaudio {TORCHAUDIO_RELEASE}+{NO_EXTENSION_LABEL}: PyPI's build does not load beside "
            "this torch, so its compiled extension is left out (LTX-2 does not use it)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffprep.families.ltx2_torchaudio",
        description="Install a torchaudio that imports beside this environment's torch (for ltx-core, the LTX-2 "
        "family): kept if one already does, else PyPI's, else PyPI's without its compiled extension.",
    )
    parser.parse_args(argv)
    print(install())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
