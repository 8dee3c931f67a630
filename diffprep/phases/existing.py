"""Phase 2, verify existing: what the output already holds, and what this run may do with it.

Empty: go on. Same fingerprint: resume (or skip when complete). Anything else
(other settings, other shapes, files that are not ours) needs an explicit
choice: ``resume`` (same settings only), ``new-dir``, ``overwrite`` or
``abort``. Nothing is deleted here without that choice.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import asdict, dataclass, field

import torch

from diffprep import contract
from diffprep.run.approvals import ABORT, Question
from diffprep.errors import ExistingOutputError, LinkInOutputError
from diffprep.writer.layouts import Layout
from diffprep.output import Output, as_output
from diffprep.validation.ownership import SHOWN, classify, listed
from diffprep.writer.plan import Plan, dtype_name, settings_diff, shape_matches
from diffprep.writer.links import link_target
from diffprep.writer.shards import load_tensor

CHOICES = ("resume", "new-dir", "overwrite", "reuse", "abort")


@dataclass
class Inspection:
    """What an output directory holds, compared with the plan of this run."""

    out_dir: str
    exists: bool
    empty: bool
    plan_fingerprint: str | None  # fingerprint of the plan found there
    same_settings: bool
    units_done: list[int] = field(default_factory=list)
    units_left: list[int] = field(default_factory=list)
    damaged_units: list[int] = field(default_factory=list)  # manifest present, shard missing or of another size
    foreign: list[str] = field(default_factory=list)  # files diffprep did not write (``diffprep.validation.ownership``): kept
    ours: list[str] = field(default_factory=list)  # files diffprep's manifests, plan and names give: what overwrite removes
    blocking: list[str] = field(default_factory=list)  # foreign files this run would replace or its trainer would read
    links: dict[str, str] = field(default_factory=dict)  # symbolic links where this run writes -> where they point
    changed_settings: list[str] = field(default_factory=list)  # "name: old -> new", when the fingerprints differ
    shape_problem: str | None = None
    bytes_on_disk: int = 0

    @property
    def matches(self) -> bool:
        """Same settings and shapes: safe to resume without asking."""
        return self.same_settings and self.shape_problem is None

    @property
    def complete(self) -> bool:
        return self.matches and not self.units_left and not self.damaged_units

    def describe(self) -> str:
        """Markdown: what exists, what would be lost, the choices."""
        lines = [f"**Output:** `{self.out_dir}`", ""]
        if self.plan_fingerprint is None:
            lines.append("- holds no diffprep plan")
        elif not self.same_settings:
            lines.append(f"- was written with other settings (fingerprint `{self.plan_fingerprint}`)"
                         + (":" if self.changed_settings else ""))
            lines += [f"  - `{change}`" for change in self.changed_settings[:SHOWN]]
            if len(self.changed_settings) > SHOWN:
                lines.append(f"  - and {len(self.changed_settings) - SHOWN} more (see its `.diffprep/plan.json`)")
        if self.shape_problem:
            lines.append(f"- its samples do not match this run's shapes: {self.shape_problem}")
        if self.units_done:
            lines.append(f"- {len(self.units_done)} finished shard(s)")
        if self.foreign:
            lines.append(f"- {len(self.foreign)} file(s) diffprep did not write, which stay whatever is chosen: "
                         f"{listed(self.foreign)}")
        if self.links:
            lines.append(f"- {len(self.links)} of them {'is a symbolic link' if len(self.links) == 1 else 'are links'} "
                         f"where this run writes: {self.links_listed()}. diffprep never writes through a link (it would "
                         "change the files it points at, outside the output), so this run can only go to a new "
                         "folder: move the link out of the output to use it")
        if self.unlinked_blocking:
            lines.append(f"- {len(self.unlinked_blocking)} of them this run would write over, or the trainer would "
                         f"read as samples beside the new ones, so `overwrite` cannot keep them: "
                         f"{listed(self.unlinked_blocking)}. Move them out of the output to overwrite it, or choose "
                         "`new-dir`")
        lines.append(f"- {_human_bytes(self.bytes_on_disk)} in all")
        lines += [
            "",
            "**Choices** (`--on-existing` / `on_existing`):",
            "- `new-dir`: leave it untouched and write to the next free `<out>-v2`, `-v3`...",
            *([] if self.blocking else [
                f"- `overwrite`: delete the {len(self.ours)} file(s) diffprep wrote there (its shards, metadata and "
                "state: the files its manifests and plan name), then encode anew"
                + (f"; the {len(self.foreign)} file(s) above that it did not write stay" if self.foreign else "")]),
            *([] if self.plan_fingerprint is None else ["- `reuse`: keep the dataset as it is and encode nothing"]),
            "- `abort`: change nothing",
        ]
        return "\n".join(lines)

    def links_listed(self) -> str:
        shown = ", ".join(f"`{name}` -> {target}" for name, target in list(self.links.items())[:SHOWN])
        return shown + (f" and {len(self.links) - SHOWN} more" if len(self.links) > SHOWN else "")

    @property
    def unlinked_blocking(self) -> list[str]:
        """The blocking files that are not links: an overwrite could go on without them."""
        return [name for name in self.blocking if name not in self.links]

    @property
    def needs_choice(self) -> bool:
        """Holds data this run cannot simply resume: someone must choose what happens to it."""
        return not self.empty and not self.matches

    def question(self) -> Question:
        return Question(
            key="existing-output",
            title=f"The output {self.out_dir} already holds data this run would change",
            description=self.describe(),
            choices=tuple(c for c in ("new-dir", "overwrite", "reuse", ABORT)
                          if not (c == "overwrite" and self.blocking or c == "reuse" and self.plan_fingerprint is None)),
            preset_hint="--on-existing new-dir|overwrite|reuse|abort (flow parameter output.on_existing)",
        )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _check_shapes(output: Output, plan: Plan, manifests) -> str | None:
    """Load the first sample of one finished shard (weights only) and compare its shapes with the plan."""
    for manifest in manifests.values():
        if not manifest.keys:
            continue
        key = manifest.keys[0]
        try:
            members: dict[str, bytes] = {}
            with output.open(manifest.shard) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    if not member.name.startswith(key + "."):
                        break  # the first sample is over: read no further (a bucket streams the rest otherwise)
                    members[member.name[len(key) + 1:]] = tar.extractfile(member).read()
            # Under the fields' own names, as this plan's layout writes them.
            for field_name, value in Layout.of_plan(plan.settings).read(members, key).items():
                if not field_name.endswith(".pth") or contract.field_stem(field_name) not in plan.expected:
                    continue  # only the tensors the plan gives a shape
                tensor = value if isinstance(value, torch.Tensor) else load_tensor(value, key=key, field=field_name)
                problem = _compare_shape(field_name, tensor, plan.expected)
                if problem:
                    return f"{manifest.shard}:{key}: {problem}"
        except Exception as exc:  # noqa: BLE001 - any unreadable sample is a mismatch to report, not a crash
            return f"{manifest.shard}:{key} cannot be read ({type(exc).__name__}: {exc})"
        return None
    return None


def _compare_shape(field_name: str, tensor, expected: dict) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"{field_name} holds a {type(tensor).__name__}, not a tensor"
    want = expected.get(contract.field_stem(field_name))
    if not shape_matches(tensor.shape, want):
        return f"{field_name} has shape {list(tensor.shape)}, this run writes {want}"
    dtype = (expected.get("dtypes") or {}).get(contract.field_stem(field_name)) or expected.get("dtype")
    if dtype and dtype_name(tensor.dtype) != dtype:
        return f"{field_name} has dtype {tensor.dtype}, this run writes {dtype}"
    return None


def inspect_output(output: Output | str | os.PathLike, plan: Plan) -> Inspection:
    """What the output holds against ``plan`` (a bucket prefix's state is synced into its staging folder first)."""
    output = as_output(output)
    if not output.remote:
        if not output.local.exists():
            return Inspection(output.uri, exists=False, empty=True, plan_fingerprint=None, same_settings=True,
                              units_left=[u.unit for u in plan.units])
        if not output.local.is_dir():
            raise ExistingOutputError(f"output {output.uri} exists and is not a directory")
    entries = output.entries()
    files, links = output.listing()
    if not entries or (entries == [contract.STATE_DIR] and not links and output.state.is_empty()):
        return Inspection(output.uri, exists=output.exists(), empty=True, plan_fingerprint=None, same_settings=True,
                          units_left=[u.unit for u in plan.units])
    old = output.state.plan()
    manifests = output.state.manifests()  # read one at a time by each pass: never all of them at once
    owned = classify(files, manifests, old, links)
    same = old is not None and old.fingerprint == plan.fingerprint
    planned = {u.unit for u in plan.units}
    committed, damaged = output.committed_units(plan.fingerprint, manifests)
    changed = set(plan.changed_units) & set(committed)  # a written sample's mask or sound file changed: redone
    kept = {u for u in committed if u not in changed}  # unit numbers only: the manifests stay on disk
    damaged = [*damaged, *changed]
    done = sorted(u for u in kept if u in planned)
    damaged = sorted(u for u in damaged if u in planned)
    left = [u.unit for u in plan.units if u.unit not in kept and u.unit not in damaged]
    inspection = Inspection(
        output.uri,
        exists=True,
        empty=False,
        plan_fingerprint=old.fingerprint if old else None,
        same_settings=same,
        units_done=done if same else [],
        units_left=left if same else [u.unit for u in plan.units],
        damaged_units=damaged if same else [],
        foreign=list(owned.foreign),
        ours=list(owned.ours),
        blocking=owned.blocking(plan),
        links={name: link_target(output.local / name) for name in owned.links_in_the_way(plan)},
        changed_settings=[] if same or old is None else settings_diff(old.settings, plan.settings),
        bytes_on_disk=output.total_bytes(),
    )
    if same:
        from diffprep.encodings import unit_files_layout

        files_layout = unit_files_layout(plan)
        check = files_layout.check_shapes if files_layout is not None else _check_shapes
        inspection.shape_problem = check(output, plan, committed.only(done))  # reads the first one or few
    return inspection


@dataclass
class Decision:
    action: str  # fresh | resume | complete | new-dir | overwrite | reuse
    out_dir: str
    inspection: dict

    def to_json(self) -> dict:
        return asdict(self)


def next_free_dir(output: Output | str | os.PathLike, fingerprint: str | None = None) -> str:
    """``<out>-v2``, ``-v3``...: the first that does not exist or is empty, or holds this plan (a path or s3:// URL)."""
    return as_output(output).next_free(fingerprint).uri


def decide(inspection: Inspection, on_existing: str | None, output: Output | None = None,
           fingerprint: str | None = None) -> Decision:
    """Turn an inspection and the user's explicit choice (or none) into an action.

    Raises ExistingOutputError when the output needs a choice that was not given,
    or when the choice is ``abort`` or cannot apply.
    """
    if on_existing is not None and on_existing not in CHOICES:
        raise ExistingOutputError(f"on_existing must be one of {', '.join(CHOICES)}, got {on_existing!r}")
    summary = asdict(inspection)
    if inspection.empty:
        return Decision("fresh", inspection.out_dir, summary)
    if inspection.links and on_existing not in ("new-dir", "reuse", "abort"):
        raise LinkInOutputError(
            f"cannot write to {inspection.out_dir}: {inspection.links_listed()} "
            f"{'is a symbolic link' if len(inspection.links) == 1 else 'are symbolic links'} where this run writes. "
            "diffprep never writes, renames or removes through a link inside an output (it would change the files "
            "it points at, outside the output). Nothing was changed: move the link out of the output, or choose "
            "--on-existing new-dir.")
    if inspection.matches:
        # Same settings: nothing would be lost, so nothing is asked and no preset answer applies
        # (a nightly run with on_existing=overwrite must append, not re-encode everything).
        if inspection.blocking and not inspection.complete:
            raise ExistingOutputError(
                f"cannot resume {inspection.out_dir}: {len(inspection.blocking)} file(s) there that diffprep did not "
                f"write have the names this run writes, or would be read by the trainer as samples: "
                f"{listed(inspection.blocking)}. Nothing was changed: move them out of the output and re-run.")
        return Decision("complete" if inspection.complete else "resume", inspection.out_dir, summary)
    if on_existing is None:
        raise ExistingOutputError(
            "the output directory already holds data that this run would change:\n"
            + inspection.describe()
            + "\n\nRe-run with --on-existing new-dir|overwrite|reuse|abort to say what to do."
        )
    if on_existing == "abort":
        raise ExistingOutputError(f"aborted (on_existing=abort); nothing under {inspection.out_dir} was changed")
    if on_existing == "resume":
        reason = inspection.shape_problem or ("it holds no diffprep plan: diffprep did not write it"
                                              if inspection.plan_fingerprint is None
                                              else "it was written with other settings")
        raise ExistingOutputError(
            f"cannot resume {inspection.out_dir}: {reason}. Resume needs the same settings; "
            "choose --on-existing new-dir or overwrite, or run with the settings in its .diffprep/plan.json."
        )
    if on_existing == "new-dir":
        # This run's fingerprint: re-run after a question it suspended on, it goes back to the folder it chose.
        return Decision("new-dir", next_free_dir(output or inspection.out_dir, fingerprint), summary)
    if on_existing == "reuse":
        if inspection.plan_fingerprint is None:
            raise ExistingOutputError(
                f"cannot reuse {inspection.out_dir}: it holds no diffprep plan, so there is no dataset of diffprep's "
                "to keep as it is (reuse keeps a dataset diffprep wrote, with other settings). Nothing was changed: "
                "choose --on-existing new-dir, or another --output-dir.")
        return Decision("reuse", inspection.out_dir, summary)
    if inspection.blocking:
        raise ExistingOutputError(
            f"cannot overwrite {inspection.out_dir}: {len(inspection.blocking)} file(s) there that diffprep did not "
            f"write would be replaced or read by the trainer as samples: {listed(inspection.blocking)}. Nothing "
            "was changed: move them out of the output, or choose --on-existing new-dir.")
    return Decision("overwrite", inspection.out_dir, summary)


__all__ = ["CHOICES", "Decision", "Inspection", "decide", "inspect_output", "next_free_dir"]
