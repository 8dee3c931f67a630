"""Every command the documentation shows runs here, as a user runs it (issue #38; the conventions: mkdocs.yml's
pages and README.md keep them, and this runner enforces them).

Sybil parses each page (README.md and every docs/**/*.md) into its examples, in page order:

- a ```console block: each `$ ` line (with its ` \\` continuation lines) is one command, run as a new process in
  ONE fresh terminal per page (tests/user_shell.py's Terminal: no PREFECT_* or DIFFPREP_* variable, its own
  PREFECT_HOME, offline) opened in a new empty folder; it must exit 0 without a traceback. Lines without `$ ` are
  output shown to the reader, not checked. `cd DIR` and `export NAME=VALUE` change the terminal, as in a shell.
- a console block preceded by the line `<!-- check: parse-only — REASON -->` (a GPU, a cluster, a gated download,
  a real bucket): its `diffprep` commands (also inside `torchrun ... -m diffprep ...`, `srun ... diffprep ...`)
  are parsed by diffprep's own argparse parser and must parse; nothing runs.
- a ```python block runs in the page's namespace, in the terminal's folder, after the console blocks above it
  (in this test's process: give it local paths, not hub ids, which resolve in the terminal's cache only).
- a ```bash / ```sh / ```shell block is refused: a command a user types is a console block, so it runs here.

Hub model ids resolve offline to the tiny sets (`diffprep tiny-model --family …`), written once per session into
the terminals' Hugging Face cache under the hub ids the pages use (models--ORG--NAME/snapshots/REV + refs/main), so
the real resolution code (diffprep/families/hub.py, huggingface_hub's snapshot_download) runs. Their weights are
random, so the terminals set DIFFPREP_MODEL__MIN_PSNR=0: the VAE round-trip check a real model passes cannot pass
with noise (a flag typed on a page still wins).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
from sybil import Document, Region, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from user_shell import REPO, Terminal

PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]

# The hub ids the pages use, and the tiny set that stands in for each (`diffprep tiny-model --family F`).
HUB_MODELS = {
    "black-forest-labs/FLUX.1-dev": "flux",
    "black-forest-labs/FLUX.1-schnell": "flux",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan",
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": "wan",
    "stabilityai/sd-vae-ft-mse": "sd-vae",
    "stabilityai/sd-vae-ft-ema": "sd-vae",
    "Lightricks/LTX-2": "ltx2",
}
SNAPSHOT = "0" * 39 + "1"  # the commit the stand-in snapshots claim to be

PARSE_ONLY = re.compile(r"<!--\s*check:\s*parse-only\s*(?:—|--|-)\s*(?P<reason>\S.*?)\s*-->\s*\Z")
SHELL_LANGUAGES = "bash|sh|shell|zsh"


# --- parsing: the regions of a page ------------------------------------------------------------------------------


def split_commands(source: str) -> list[str]:
    """The commands of a console block: each `$ ` line and its ` \\` continuation lines, as one string."""
    commands: list[str] = []
    continued = False
    for line in source.splitlines():
        if continued:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue  # output shown to the reader
        continued = line.endswith(" \\")
    return commands


def console_parser(document: Document):
    """Console blocks, each a region whose ``parsed`` is (commands, parse-only reason or None)."""
    for region in FencedCodeBlockLexer("console")(document):
        before = document.text[:region.start].rstrip()
        marker = PARSE_ONLY.search(before.rsplit("\n", 1)[-1] if before else "")
        commands = split_commands(str(region.lexemes["source"]))
        where = document.line_column(region.start)
        if not commands:
            raise ValueError(f"{document.path}, {where}: a console block without a `$ ` command")
        yield Region(region.start, region.end, (commands, marker and marker["reason"]), run_console)


def refused_parser(document: Document):
    """Blocks a user would type but that would not run here: bash/sh blocks, a parse-only marker on no console block."""
    for region in FencedCodeBlockLexer(SHELL_LANGUAGES)(document):
        raise ValueError(f"{document.path}, {document.line_column(region.start)}: a ```{region.lexemes['language']} "
                         "block; commands a user types go in ```console blocks (`$ ` lines), which the tests run")
    for marker in re.finditer(r"^<!--\s*check:[^\n]*-->", document.text, re.M):
        after = document.text[marker.end():].lstrip("\n")
        if not PARSE_ONLY.search(marker.group()) or not after.startswith("```console"):
            raise ValueError(f"{document.path}, {document.line_column(marker.start())}: {marker.group()!r} must be "
                             "`<!-- check: parse-only — REASON -->` on the line right above a ```console block")
    return ()


SYBIL = Sybil(parsers=[console_parser, PythonCodeBlockParser(), refused_parser], path="..")


# --- evaluation ----------------------------------------------------------------------------------------------------


def diffprep_argv(command: str) -> list[str] | None:
    """The arguments after `diffprep` in a command line (`diffprep …`, `python -m diffprep …`, `torchrun … -m
    diffprep …`, `srun … diffprep …`, `VAR=x diffprep …`), up to a shell operator; None when it runs no diffprep."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    for i, word in enumerate(words):
        if word not in ("diffprep", ".venv/bin/diffprep"):
            continue
        before = words[i - 1] if i else ""
        # diffprep the program: first on the line, after `-m`, a launcher, or a word with `=` (VAR=x, --opt=x)
        if not before or before in ("-m", "--no-python", "srun", "exec", "nice") or "=" in before:
            rest = words[i + 1:]
            end = next((j for j, w in enumerate(rest) if w in ("|", "&&", "||", ";", ">", "2>", "&")), len(rest))
            return rest[:end]
    return None


def parse_with_cli(command: str) -> None:
    """Parse a command's diffprep arguments with the real parser (argparse exits 2 on what it does not take)."""
    from diffprep.cli import build_parser

    argv = diffprep_argv(command)
    if argv is None:
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`{command}` does not parse: diffprep {' '.join(argv)} (exit {exc.code})") from None


def run_console(example) -> None:
    """Run (or parse) a console block's commands; a failure names the page and the block's line."""
    try:
        _run_commands(example)
    except AssertionError as failure:
        raise AssertionError(f"{example.path}, line {example.line}:\n{failure}") from None


def _run_commands(example) -> None:
    commands, parse_only = example.parsed
    terminal: Terminal = example.namespace["terminal"]
    for command in commands:
        if parse_only:
            parse_with_cli(command)
            continue
        words = shlex.split(command)
        if words and words[0] == "cd" and len(words) == 2:
            terminal.cwd = (terminal.cwd / Path(words[1]).expanduser()).resolve()
            continue
        if words and words[0] == "export" and all("=" in w for w in words[1:]):
            terminal.env.update(w.split("=", 1) for w in words[1:])
            continue
        terminal.shell(command).ok()


# --- the Hugging Face cache the pages' hub ids resolve in ------------------------------------------------------------


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory):
    """A Hugging Face cache holding, per hub id of HUB_MODELS, the tiny set of its family (each family written once
    by `diffprep tiny-model`, on first use): the layout huggingface_hub reads offline."""
    from diffprep.cli import main

    root = tmp_path_factory.mktemp("hf-cache")
    written: dict[str, Path] = {}

    def ensure(repo_id: str) -> None:
        family = HUB_MODELS[repo_id]
        repo = root / f"models--{repo_id.replace('/', '--')}"
        if repo.is_dir():
            return
        if family not in written:
            written[family] = root.parent / f"tiny-{family}"
            assert main(["tiny-model", str(written[family]), "--family", family]) == 0
        shutil.copytree(written[family], repo / "snapshots" / SNAPSHOT, symlinks=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(SNAPSHOT)

    ensure.root = root
    return ensure


@pytest.mark.user_path
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page(page: Path, hub_cache, tmp_path, monkeypatch):
    """Every example of ``page`` in order: its commands run (or, marked, parse), its Python runs."""
    document = SYBIL.parse(page)
    text = page.read_text()
    for repo_id in HUB_MODELS:
        if re.search(rf"(?<![\w/.-]){re.escape(repo_id)}(?![\w.-])", text):
            hub_cache(repo_id)
    terminal = Terminal(tmp_path / "work", tmp_path / "prefect-home")
    terminal.env.update(HF_HUB_CACHE=str(hub_cache.root), DIFFPREP_MODEL__MIN_PSNR="0")
    document.namespace["terminal"] = terminal
    monkeypatch.chdir(terminal.cwd)
    try:
        for example in document:
            monkeypatch.chdir(terminal.cwd)
            example.evaluate()
    finally:
        print(f"{page}:\n{terminal.report()}")
