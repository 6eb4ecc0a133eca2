"""MkDocs hooks: the pages generated from the code's one source (the command line's flags, the configuration's
keys) and the repository's own documents (BENCHMARKS.md, RELIABILITY.md, CHANGELOG.md), so that nothing is kept
twice."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]

# repository documents shown as pages: (file, page, links they make to other repository files → pages)
DOCUMENTS = {"BENCHMARKS.md": "benchmarks.md", "RELIABILITY.md": "faults.md", "SECURITY.md": "security.md",
             "CHANGELOG.md": "changelog.md"}


def on_files(files, config):
    if str(ROOT / "src") not in sys.path:  # the code the references are generated from: this checkout's
        sys.path.insert(0, str(ROOT / "src"))
    for source, page in DOCUMENTS.items():
        files.append(File.generated(config, page, content=_linked((ROOT / source).read_text())))
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "reference/config.md", content=config_reference()))
    return files


def _linked(text: str) -> str:
    """A repository document's links to others as links between pages; to anything else, as plain text."""
    for source, page in DOCUMENTS.items():
        text = text.replace(f"]({source}", f"]({page}")
    text = re.sub(r"\]\(README\.md(#[^)]*)?\)", "](index.md)", text)
    # a link to a source file or folder: its path as code (the manual is not the repository)
    return re.sub(r"\[([^\]]+)\]\((?!https?://|#)([^)]+\.(?:py|sh|toml|txt|json|csv)|[^).]+/)\)", r"\1 (`\2`)", text)


def cli_reference() -> str:
    """Every command and flag, from the parser the CLI itself runs (sparklm.cli.build_parser)."""
    from sparklm.cli import build_parser

    parser = build_parser()
    out = ["# Command line", "", "Generated from the parser `sparklm` runs (`sparklm.cli.build_parser`); "
           "`sparklm COMMAND --help` prints the same.", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, cmd in sub.choices.items():
        out += [f"## `sparklm {name}`", "", helps.get(name) or "", "", "```text", cmd.format_usage().strip(), "```", ""]
        for group in cmd._action_groups:
            rows = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
            if not rows:
                continue
            out += [f"**{group.title}**", "", "| flag | meaning |", "|---|---|"]
            for a in rows:
                flags = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.metavar or a.dest}`"
                text = (a.help or "").replace("|", "\\|").replace("\n", " ")
                if a.choices and "one of" not in text:
                    text += f" (one of: {', '.join(str(c) for c in a.choices)})"
                out.append(f"| {flags} | {text} |")
            out.append("")
    return "\n".join(out)


def config_reference() -> str:
    """Every configuration key with its type, default and meaning (sparklm.config.describe, as `sparklm config`)."""
    from sparklm.config import describe

    return "\n".join(["# Configuration keys", "", "Generated from `sparklm.config` (the text `sparklm config` prints "
                      "and `configs/default.toml` holds): every key is optional.", "", "```toml", describe(), "```", ""])
