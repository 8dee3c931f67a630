"""No family's libraries are imported by two threads at once (issue 35).

A terminal run loads its encoders in a start-up thread (``flows/startup.py``,
``load_ahead``) while the main thread plans the run, and both import
transformers, diffusers and ltx-core. Two threads importing those package trees
at once can each hold one module's import lock while waiting for the other's;
Python then hands one of them a module still being executed: ``cannot import
name 'Gemma3Config' from 'transformers'``, a ``_DeadlockError`` or a hang, in 9
of 10 LTX-2 runs from a terminal, depending on timing.

The race test does not wait for that timing. In a fresh process (nothing
imported yet, as a command starts) it takes the command's own start-up steps
and watches every execution of a module of those libraries, in which thread,
without changing what is imported. It holds the start-up thread at its first
such module until the main thread has begun its plan phase, and the main thread
until that moment has come, so that the two always overlap: then any module the
plan phase executes while the start-up thread is inside one of its own (or the
reverse) is named. Before ``diffprep.families.imports`` there were dozens, on
every run; with it, none.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffprep.tools.demo import write_av_clip, write_demo_dataset

REPO = Path(__file__).resolve().parent.parent

# The libraries a family imports (the top package names): what the gate in diffprep/families/imports.py covers.
LIBRARIES = ("transformers", "diffusers", "ltx_core", "torchaudio", "tokenizers", "safetensors", "accelerate",
             "bitsandbytes")

# Run in a fresh interpreter: argv[1] is the settings' overrides as JSON. Prints one JSON line.
CHILD = r'''
import json, logging, sys, threading, time
from importlib.abc import MetaPathFinder

LIBRARIES = set(sys.argv[2].split(","))
WARM = "diffprep-warm"
inside: dict[str, int] = {}  # thread name -> how deep it is in executing modules of LIBRARIES
overlaps: list[list[str]] = []
state = threading.Lock()
warm_importing, plan_started = threading.Event(), threading.Event()


class Watched:
    """A module's own loader, its execution counted for its thread (the module is what it would have been)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        me = threading.current_thread().name
        if me == WARM and not warm_importing.is_set():
            warm_importing.set()  # the start-up thread is importing: hold it until the plan phase has begun
            plan_started.wait(120)
        with state:
            others = sorted(name for name, depth in inside.items() if depth and name != me)
            if others:
                overlaps.append([me, module.__name__, *others])
            inside[me] = inside.get(me, 0) + 1
        try:
            self.loader.exec_module(module)
        finally:
            with state:
                inside[me] -= 1

    def __getattr__(self, name):
        return getattr(self.loader, name)


class Watcher(MetaPathFinder):
    """Finds nothing itself: wraps the loader that the other finders give a module of LIBRARIES."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in LIBRARIES:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = Watched(spec.loader)
                    return spec
        return None


sys.meta_path.insert(0, Watcher())

# The command's own start-up, as diffprep.cli runs a terminal encode without PREFECT_API_URL (flows/recorded.py's
# run_recorded, less the embedded server's process): quieted libraries, the pipeline imported, the encoders
# loading in the start-up thread, then the plan phase here.
from diffprep.cli import quiet_diffusers, quiet_libraries

quiet_libraries()
quiet_diffusers()
from diffprep.config import load_settings
from diffprep.encodings import encoding_for
from diffprep.flows.startup import load_ahead
from diffprep.phases.pipeline import plan_output, settings_output

not_loaded = []
handler = logging.Handler(logging.DEBUG)
handler.emit = lambda record: not_loaded.append(record.getMessage())
logging.getLogger("diffprep.startup").addHandler(handler)
logging.getLogger("diffprep.startup").setLevel(logging.DEBUG)

settings = load_settings(None, json.loads(sys.argv[1]))
warming = load_ahead(settings, "preencoded")
met = warm_importing.wait(120)
plan_started.set()
error = None
try:
    plan = plan_output(settings, settings_output(settings).open(), encoding_for(settings, "preencoded", None))
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
warming.join(240)
print(json.dumps({"met": met, "overlaps": overlaps, "error": error, "not_loaded": not_loaded,
                  "warming": warming.is_alive()}))
'''


def _clips(root: Path, *, audio: bool) -> Path:
    rows = []
    for index in range(2):
        write_av_clip(root / f"{index}.mp4", seed=index, audio_layout="stereo" if audio else None)
        rows.append({"caption": f"a cat walking in the city {index}", "video": f"{index}.mp4"})
    listing = root / "dataset.json"
    listing.write_text(json.dumps(rows), encoding="utf-8")
    return listing


def _overrides(family: str, model: Path, tmp_path: Path) -> dict:
    data = tmp_path / "data"
    data.mkdir()
    overrides = {"output": {"output_dir": str(tmp_path / "out")},
                 "model": {"model_path": str(model), "precision": "fp32", "device": "cpu"}}
    if family == "flux":
        write_demo_dataset(data, samples=4)
        overrides |= {"source": {"type": "directory", "input_dir": str(data)}, "image": {"image_size": 32}}
    else:
        listing = _clips(data, audio=family == "ltx2")
        overrides |= {"source": {"type": "metadata", "metadata_file": str(listing)},
                      "video": {"resolution_buckets": "64x64x9" if family == "ltx2" else "32x24x5"}}
    if family == "ltx2":
        overrides["output"]["layout"] = "ltx"  # the command (README: LTX-2, --layout ltx)
    return overrides


@pytest.mark.parametrize("family", ["ltx2", "wan", "flux"])
def test_the_start_up_thread_and_the_plan_phase_never_import_a_family_at_once(family, request, tmp_path):
    model = request.getfixturevalue({"ltx2": "tiny_ltx2", "wan": "tiny_wan", "flux": "tiny_model"}[family])
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"
    try:
        run = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", CHILD, json.dumps(_overrides(family, model, tmp_path)),
             ",".join(LIBRARIES)],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
        )
    except subprocess.TimeoutExpired as hung:  # the race's third outcome: two threads waiting on each other
        pytest.fail(f"the start-up thread and the plan phase hung:\n{hung.stderr}")
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["met"], "the start-up thread imported nothing of the family's libraries"
    assert report["error"] is None, report["error"]
    assert not report["warming"] and report["not_loaded"] == [], report["not_loaded"]
    shown = "\n".join(f"{thread} executed {module} while {', '.join(others)} executed another"
                      for thread, module, *others in report["overlaps"][:20])
    assert report["overlaps"] == [], f"{len(report['overlaps'])} modules imported at once:\n{shown}"


# --- every import of a family's libraries goes through the gate -----------------------------------------------------

SCOPE = [*sorted((REPO / "diffprep" / "families").glob("*.py")), *sorted((REPO / "diffprep" / "encodings").glob("*.py")),
         REPO / "flows" / "startup.py", REPO / "flows" / "recorded.py"]
# The gate itself, and the torchaudio check it runs first (also run alone by `diffprep tiny-model`, before anything).
EXEMPT = {"imports.py", "ltx2_torchaudio.py"}


def _ungated_imports(source: str, where: str) -> list[str]:
    """Imports of LIBRARIES in ``source`` that can run outside a ``with family_imports(...)`` block
    (``TYPE_CHECKING`` ones never run)."""
    found: list[str] = []

    def visit(node: ast.AST, gated: bool) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.With):
            gated = gated or any(isinstance(item.context_expr, ast.Call)
                                 and getattr(item.context_expr.func, "id", None) == "family_imports"
                                 for item in node.items)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not gated:
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
            if any(name.partition(".")[0] in LIBRARIES for name in names):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, gated)

    visit(ast.parse(source), False)
    return found


def test_every_import_of_a_family_library_goes_through_the_gate():
    ungated = [line for path in SCOPE if path.name not in EXEMPT
               for line in _ungated_imports(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert ungated == [], ("import these inside `with family_imports(<family>):` (diffprep/families/imports.py):\n"
                           + "\n".join(ungated))


def test_the_gate_check_names_an_import_outside_the_gate():
    """The check above can fail: an import outside the gate is named; one inside it or under TYPE_CHECKING is not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from transformers import T5Config\n"
              "def f():\n    import ltx_core.loader\n"
              "def g():\n    with family_imports('flux'):\n        from diffusers import AutoencoderKL\n")
    assert _ungated_imports(source, "probe.py") == ["probe.py:5: import ltx_core.loader"]
