"""The reference pages, written from the code so that nothing is typed twice: `python -m diffprep.cli.docs`.

- docs/reference/settings.md: every setting of every section (diffprep/config/sections.py) with its flag, its
  environment variable, its default and its own description;
- docs/reference/cli.md: every command and subcommand with each argument, from the argparse parser the command
  itself parses with (``diffprep.cli.build_parser``).

tests/test_docs_reference.py fails when the committed pages differ from what this writes now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[2]
PAGES = {"settings": Path("docs/reference/settings.md"), "cli": Path("docs/reference/cli.md")}
COMMAND = "python -m diffprep.cli.docs"
HEADER = f"<!-- Written by `{COMMAND}` from the code: edit the code, then run it again. -->\n\n"


def cell(text: Any) -> str:
    """A value inside a Markdown table cell: one line, pipes escaped, no `<name>` taken for an HTML tag."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: Any) -> str:
    """A value in code style inside a table cell (no entity: code shows its text as it is)."""
    return "`" + " ".join(str(text).split()).replace("|", "\\|") + "`" if str(text) else ""


def settings_page() -> str:
    from diffprep.cli.flags import ENCODE_FLAGS, FLAG_ALIASES, INGEST_OUTPUT_FLAGS, RAW_FLAGS

    from diffprep.config import SECTIONS

    flags: dict[tuple[str, str], list[str]] = {}
    for table in (ENCODE_FLAGS, RAW_FLAGS, INGEST_OUTPUT_FLAGS):
        for flag, target in table.items():
            names = flags.setdefault(target, [])
            for name in (flag, *FLAG_ALIASES.get(flag, ())):
                if name not in names:
                    names.append(name)
    lines = [HEADER, "# Settings\n\n",
             "Every setting, by section. A setting is given, lowest priority first, by its default, a YAML file "
             "(`--config`, a section per heading below), its environment variable, or its flag. The same names are "
             "the parameters of the Prefect flows.\n"]
    for section, model in SECTIONS.items():
        lines.append(f"\n## {section}\n\n| key | flag | environment variable | default | description |\n"
                     "|---|---|---|---|---|\n")
        for key, field in model.model_fields.items():
            default = "" if field.default is PydanticUndefined else field.default
            default = code(default) if default not in (None, "") else ""
            flag = ", ".join(code(name) for name in flags.get((section, key), []))
            env = code(f"DIFFPREP_{section.upper()}__{key.upper()}")
            lines.append(f"| `{key}` | {flag} | {env} | {default} | {cell(field.description)} |\n")
    return "".join(lines)


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every (sub)command under ``parser``: its full name, its parser and its one-line help, in the parser's order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{prefix} {name}"
                found.append((full, sub, helps.get(name) or ""))
                found.extend(_commands(sub, full))
    return found


def cli_page() -> str:
    from diffprep.cli import build_parser

    parser = build_parser()
    lines = [HEADER, "# Commands\n\n", cell(parser.description), "\n"]
    for name, sub, help_text in _commands(parser, "diffprep"):
        arguments = [a for a in sub._actions
                     if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not arguments and any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            lines.append(f"\n## {name}\n\n{cell(help_text)}\n")
            continue
        lines.append(f"\n## {name}\n\n{cell(help_text)}\n\n| argument | value | default | description |\n"
                     "|---|---|---|---|\n")
        for action in arguments:
            names = ", ".join(code(n) for n in action.option_strings) or code(action.dest)
            if action.choices:
                value = " \\| ".join(code(c) for c in action.choices)
            elif action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
                value = ""
            else:
                value = code(action.metavar or action.dest.split(".")[-1].upper())
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS, False) or not action.option_strings else code(default)
            described = (action.help or "").replace("%%", "%")  # argparse's escape of %
            lines.append(f"| {names} | {value} | {shown} | {cell(described)} |\n")
    return "".join(lines)


def pages() -> dict[Path, str]:
    """Each reference page's path (relative to the checkout) and its text, as the code gives them now."""
    return {PAGES["settings"]: settings_page(), PAGES["cli"]: cli_page()}


def main(argv: list[str] | None = None) -> int:
    root = Path(argv[0]) if argv else REPO
    for path, text in pages().items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
