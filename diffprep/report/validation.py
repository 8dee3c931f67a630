"""The validation report: every check with its detail, a summary, and how it reads as Markdown."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffprep.report.checks import Check
from diffprep.errors import DatasetValidationError


@dataclass
class ValidationReport:
    out_dir: str
    ok: bool
    checks: list[Check]
    summary: dict[str, Any]

    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def raise_if_failed(self) -> None:
        if not self.ok:
            names = ", ".join(check.name for check in self.failed())
            raise DatasetValidationError(f"validation of {self.out_dir} failed ({names}):\n{self.to_markdown()}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self, pictures: bool = False) -> str:
        """The report as Markdown; ``pictures`` embeds the contact sheet (for a Prefect artifact, not a terminal)."""
        lines = [f"# Validation {'passed' if self.ok else 'FAILED'}: `{self.out_dir}`", ""]
        lines += ["| | check | detail |", "|---|---|---|"]
        for check in self.checks:
            detail = check.detail.replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| {'ok' if check.ok else '**FAIL**'} | {check.name} | {detail} |")
        s = self.summary
        lines += ["", "## Summary", "", "| | |", "|---|---|"]
        for key in ("encoding", "shards", "samples", "bytes", "bytes_per_sample", "max_load"):
            if key in s:
                lines.append(f"| {key} | {s[key]} |")
        for split, info in s.get("splits", {}).items():
            lines.append(f"| {split} | shards {info.get('shards')}, samples {info.get('samples')}, "
                         f"loaded {info.get('loaded', 0)} |")
        if "loaded" in s:
            lines.append(f"| loaded | {s['loaded']['samples']} samples: {s['loaded']['how']} |")
        if "expected" in s:
            lines.append(f"| expected ({s['expected'].get('source')}) | "
                         f"{ {k: v for k, v in s['expected'].items() if k != 'source'} } |")
        for name, info in s.get("fields", {}).items():
            shapes = ", ".join(f"{shape} ×{count}" for shape, count in info["shapes"].items())
            lines.append(f"| {name} | {shapes}; {', '.join(info['dtypes'])} |")
        if "images" in s:
            lines.append(f"| images | {s['images']} |")
        if "latent_stats" in s:
            stats = s["latent_stats"]
            if "mean" in stats:
                lines.append(f"| latent mean | {', '.join(f'{v:.4f}' for v in stats['mean'])} |")
                lines.append(f"| latent std | {', '.join(f'{v:.4f}' for v in stats['std'])} |")
            if "count" in stats:
                lines.append(f"| latent values per channel | {stats['count']} ({stats['samples']} samples) |")
            if "condition" in stats:
                lines.append(f"| latent covariance condition number | {stats['condition']:.4g} |")
        if "rejects" in s:
            rejects = s["rejects"]
            reasons = ", ".join(f"`{reason}` {n}" for reason, n in rejects["by_reason"].items())
            lines.append(f"| rejected | {rejects['rejected']} of {rejects['inputs']} inputs"
                         f"{': ' + reasons if reasons else ''} |")
        if s.get("foreign"):
            lines.append(f"| not in dataset | {', '.join(s['foreign'])} |")
        lines += _previews_markdown(s.get("previews"))
        sheet = (s.get("previews") or {}).get("contact_sheet")
        if pictures and sheet and Path(sheet).is_file():
            from diffprep.report.pictures import markdown_image

            lines += ["", markdown_image(sheet)]
        return "\n".join(lines) + "\n"


def _previews_markdown(previews: dict[str, Any] | None) -> list[str]:
    if not previews:
        return []
    lines = ["", "## Previews", ""]
    if "note" in previews:
        return lines + [previews["note"]]
    lines += ["| sample | source | PSNR (dB) | |", "|---|---|---:|---|"]
    for sample in previews["samples"]:
        value = "" if sample["psnr_db"] is None else f"{sample['psnr_db']:.2f}"
        lines.append(f"| {sample['key']} | {sample['source_id'] or ''} | {value} | {sample['note']} |")
    lines += ["", f"Contact sheet (source left, decoded right): `{previews['contact_sheet']}`"]
    return lines
