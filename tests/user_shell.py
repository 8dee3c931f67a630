"""`diffprep` as a user runs it, for the user-path tests (tests/test_user_path_*.py): a fresh terminal.

A terminal here is what a user has after `. .venv/bin/activate`: the venv's `diffprep` on PATH, this checkout's
packages (PYTHONPATH), offline, no PREFECT_API_URL (so an encode runs in the command and records itself on an
embedded server started in the terminal's own PREFECT_HOME), no PREFECT_* or DIFFPREP_* variable of the shell
the tests were started from. Commands are written as the README writes them, one string each, and run as new
processes in the terminal's working folder, so relative paths (`./out`) mean what they mean for the user.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def terminal_env(home: Path) -> dict[str, str]:
    """A fresh terminal's environment with ``home`` as its PREFECT_HOME (no server: none is named)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFPREP_", "PREFECT_"))}
    env.update(
        PREFECT_HOME=str(home),
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        HF_HUB_OFFLINE="1",
        # This checkout's packages, not those of wherever the project is installed from.
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


@dataclass
class Ran:
    """A finished command: what the user typed, its exit code and what it printed."""

    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, chars: int = 4000) -> str:
        return f"$ {self.command}\n(exit {self.returncode} after {self.seconds:.1f} s)\n{self.output[-chars:]}"

    def ok(self) -> Ran:
        """This command, asserted to have succeeded the way a user sees success: exit 0, no traceback."""
        assert self.returncode == 0, self.tail()
        assert "Traceback (most recent call last)" not in self.output, self.tail()
        return self

    def refused(self, *phrases: str) -> Ran:
        """This command, asserted to have refused the way a user should see it: `diffprep: error:` with the
        reason (``phrases``), exit 2 (diffprep.cli.main's code for a DiffprepError), no traceback."""
        assert self.returncode == 2 and "diffprep: error:" in self.stderr, self.tail()
        assert "Traceback (most recent call last)" not in self.output, self.tail()
        return self.says(*phrases)

    def says(self, *lines: str) -> Ran:
        """Each of ``lines`` appears in what the command printed (stdout or stderr)."""
        for line in lines:
            assert line in self.output, f"expected {line!r} in the output of\n{self.tail()}"
        return self


class Terminal:
    """A terminal opened in ``cwd`` with its own PREFECT_HOME; every command is a new process."""

    def __init__(self, cwd: Path, home: Path) -> None:
        self.cwd = Path(cwd)
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.env = terminal_env(Path(home))
        self.history: list[Ran] = []

    def run(self, command: str, timeout: float = 600) -> Ran:
        """Run ``command`` (a shell-style line; ``diffprep`` resolves on PATH to the venv's entry point)."""
        args = shlex.split(command)
        start = time.monotonic()
        done = subprocess.run(args, env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=timeout)
        ran = Ran(command, done.returncode, done.stdout, done.stderr, time.monotonic() - start)
        self.history.append(ran)
        return ran

    def shell(self, command: str, timeout: float = 600) -> Ran:
        """Run ``command`` as the user's shell runs a line they type (bash: `VAR=x cmd`, pipes, globs, `~`, ` \\`
        continuation lines), a new process in the terminal's folder: the documentation's console blocks
        (tests/test_docs.py) are run this way."""
        start = time.monotonic()
        done = subprocess.run(["bash", "-c", command], env=self.env, cwd=self.cwd, capture_output=True, text=True,
                              timeout=timeout)
        ran = Ran(command, done.returncode, done.stdout, done.stderr, time.monotonic() - start)
        self.history.append(ran)
        return ran

    def report(self) -> str:
        """Each command run so far with its seconds, for the layer's time (printed with ``pytest -s``)."""
        return "\n".join(f"{ran.seconds:6.1f} s  exit {ran.returncode}  {ran.command}" for ran in self.history)


def module_terminal(tmp_path_factory, name: str, module: str) -> Iterator[Terminal]:
    """A test module's one terminal (its ``term`` fixture yields from this): its working folder holds the inputs and
    outputs, its PREFECT_HOME is new; the commands and their seconds are printed at the end (``pytest -s``)."""
    root = tmp_path_factory.mktemp(name)
    term = Terminal(root / "work", root / "prefect-home")
    yield term
    print(f"\n{module}: commands and their seconds\n{term.report()}")


def recorded(ran: Ran) -> Ran:
    """An encode without a server: it ran in the command and was recorded on the embedded server (README, Commands)."""
    return ran.says("recorded as flow run")


def written(ran: Ran) -> Ran:
    """The command that wrote a dataset, for a test over that dataset: when it failed, the test fails with the
    command's own output (every test of a dataset then names the command, not a missing file)."""
    if ran.returncode != 0:
        import pytest

        pytest.fail(f"the command that writes this dataset failed:\n{ran.tail()}")
    return ran


# --- the commands over a written dataset (README, Commands), as a user checks what each gave ------------------------


def validate(term: Terminal, out: str) -> Ran:
    return term.run(f"diffprep validate {out}").ok().says("# Validation passed")


def decode(term: Terminal, out: str, to: str, samples: int = 2) -> Ran:
    ran = term.run(f"diffprep decode {out} --samples {samples} --to {to}").ok().says(f"{samples} samples of the")
    assert (term.cwd / to / "contact_sheet.png").is_file(), ran.tail()
    return ran


def latent_stats(term: Terminal, out: str, to: str) -> dict:
    """``diffprep latent-stats OUT --output FILE``; the file as GAE's trainer loads it."""
    import torch

    ran = term.run(f"diffprep latent-stats {out} --output {to}").ok().says("latent statistics of")
    stats = torch.load(term.cwd / to, weights_only=True)
    assert stats["mean"].dim() == 1 and stats["std"].shape == stats["mean"].shape, ran.tail()
    assert int(stats["samples"]) > 0 and bool(torch.isfinite(stats["std"]).all()), ran.tail()
    return stats


def ignore_list(term: Terminal, out: str) -> Ran:
    """Nothing is broken in a fresh dataset: exit 0 and the empty list FastGen's config can name."""
    import json

    ran = term.run(f"diffprep ignore-list {out}").ok().says("0 broken")
    assert json.loads((term.cwd / out / "ignore_index.json").read_text()) == {}, ran.tail()
    return ran


def finalize(term: Terminal, out: str) -> Ran:
    return term.run(f"diffprep finalize {out}").ok().says("# Validation passed")
