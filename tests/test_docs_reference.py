"""The reference pages are the code's: docs/reference/settings.md and cli.md are what `python -m diffprep.cli.docs`
writes from the settings' declarations and the command's parser now, so a setting or flag added, renamed or
described anew without running it fails here."""

from __future__ import annotations

from diffprep.cli import docs
from user_shell import REPO


def test_reference_pages_are_current():
    for path, text in docs.pages().items():
        committed = (REPO / path).read_text() if (REPO / path).is_file() else ""
        assert committed == text, f"{path} is stale: run `{docs.COMMAND}` and commit the pages it writes"


def test_every_setting_and_every_command_is_on_its_page():
    from diffprep.cli import build_parser
    from diffprep.config import SECTIONS

    settings, cli = docs.settings_page(), docs.cli_page()
    for section, model in SECTIONS.items():
        for key in model.model_fields:
            assert f"| `{key}` |" in settings and f"DIFFPREP_{section.upper()}__{key.upper()}" in settings, key
    for name, _parser, _help in docs._commands(build_parser(), "diffprep"):
        assert f"\n## {name}\n" in cli, name
    assert "`--model-path`" in cli and "%%" not in cli
