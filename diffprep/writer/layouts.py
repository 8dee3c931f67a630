"""How a dataset's samples are named on disk: the output layout (``--layout``, ``--key-map``).

(A top-level module, not under ``encodings/``: the cookers, which training code imports, read it without
loading the encodings and their encoders.)

Every encoding hands its samples over under diffprep's field names
(``latents.pth``, ``prompt_embeds.pth``, ...). A layout writes the same samples
under other member names: ``energon`` keeps them; ``--key-map`` renames some
(each keeps its extension, which picks the decoder); a named layout such as
``fastgen`` is a preset per encoding (``Encoding.layout_presets``): members
that may hold several fields as one tuple, the negative prompt's embeddings as
``.npy`` files at the output's top, and ``shard_counts.json``. The layout is
recorded in plan.json's settings (so in the fingerprint) and in dataset.yaml's
subflavors, so the audit, validation, decoding and the cookers read back what
was written. The default layout is recorded nowhere: an energon plan, its
fingerprint and its dataset.yaml stay exactly as they always were.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffprep import contract
from diffprep.errors import ConfigError
from diffprep.writer.shards import json_file_bytes, load_tensor_tuple, npy_bytes

_MEMBER_STEM = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class LayoutPreset:
    """What a named layout writes for one encoding.

    ``members``: member -> the fields it holds (two or more: a tuple, in that
    order); fields not named keep their own names. ``negative``: file at the
    output's top -> the field of the negative prompt's embeddings it holds.
    ``shard_counts``: whether finalize writes ``shard_counts.json``.
    """

    members: Mapping[str, tuple[str, ...]]
    negative: Mapping[str, str] = field(default_factory=dict)
    shard_counts: bool = False


@dataclass(frozen=True)
class Layout:
    """The member names of one dataset (empty ``members``: every field under its own name)."""

    name: str = contract.LAYOUT_ENERGON
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # member -> the fields it holds
    negative_prompt: str | None = None  # the text whose embeddings go to the ``negative`` files
    negative: Mapping[str, str] = field(default_factory=dict)  # top-level file -> field
    shard_counts: bool = False

    # --- recorded form -------------------------------------------------------------------------------------------

    @property
    def is_default(self) -> bool:
        return self == Layout()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "members": {m: list(f) for m, f in self.members.items()},
                "negative_prompt": self.negative_prompt, "negative": dict(self.negative),
                "shard_counts": self.shard_counts}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "Layout":
        if not data:
            return cls()
        return cls(name=data["name"], members={m: tuple(f) for m, f in data.get("members", {}).items()},
                   negative_prompt=data.get("negative_prompt"), negative=dict(data.get("negative", {})),
                   shard_counts=bool(data.get("shard_counts")))

    @classmethod
    def of_plan(cls, plan_settings: Mapping[str, Any] | None) -> "Layout":
        """The layout a plan's byte settings record (none recorded: energon's own names)."""
        return cls.from_json((plan_settings or {}).get("layout"))

    def subflavors(self) -> dict[str, Any]:
        """What dataset.yaml's subflavors add (nothing for the default layout)."""
        return {} if self.is_default else {"layout": self.to_json()}

    @classmethod
    def of_subflavors(cls, subflavors: Mapping[str, Any] | None) -> "Layout":
        """The layout of a sample Energon hands over (its ``__subflavors__``) or of a dataset.yaml's subflavors."""
        return cls.from_json((subflavors or {}).get("layout"))

    # --- names ---------------------------------------------------------------------------------------------------

    def member_names(self, fields: Iterable[str]) -> list[str]:
        """The members a sample with these fields is written as."""
        fields = list(fields)
        if not self.members:
            return fields
        held = {name for names in self.members.values() for name in names}
        return ([m for m, names in self.members.items() if any(n in fields for n in names)]
                + [f for f in fields if f not in held])

    def fields_of(self, members: Iterable[str]) -> list[str]:
        """The fields these written members hold (a member the layout does not name is taken as it is)."""
        return [name for member in members for name in self.members.get(member, (member,))]

    # --- samples -------------------------------------------------------------------------------------------------

    def write(self, fields: Mapping[str, Any]) -> Mapping[str, Any]:
        """A sample's fields under this layout's member names (several fields of one member: a tuple)."""
        if not self.members:
            return fields
        written: dict[str, Any] = {}
        for member, names in self.members.items():
            present = [name for name in names if name in fields]
            if not present:
                continue
            if len(present) != len(names):
                raise ValueError(f"member {member} holds {list(names)}, the sample has only {present}")
            written[member] = fields[names[0]] if len(names) == 1 else tuple(fields[name] for name in names)
        held = {name for names in self.members.values() for name in names}
        unplaced = sorted(set(fields) - held)
        if unplaced:
            raise ValueError(f"layout {self.name!r} has no member for the fields {unplaced}")
        return written

    def read(self, sample: Mapping[str, Any], key: str = "?") -> dict[str, Any]:
        """A stored sample (member -> bytes) under the fields' own names; a tuple member split into its
        tensors (loaded weights only). Members the layout does not name, ``__key__`` and such, stay."""
        if not self.members:
            return dict(sample)
        fields: dict[str, Any] = {}
        for member, value in sample.items():
            names = self.members.get(member)
            if names is None:
                fields[member] = value
            elif len(names) == 1:
                fields[names[0]] = value
            else:
                items = load_tensor_tuple(value, len(names), key=key, field=member) if isinstance(value, bytes) \
                    else value
                fields.update(zip(names, items))
        return fields

    # --- files at the output's top -------------------------------------------------------------------------------

    def write_negative(self, output: Any, embeddings: Mapping[str, torch.Tensor]) -> None:
        """The negative prompt's embeddings (field -> one sample's tensor) into their ``.npy`` files, float32."""
        for name, field_name in self.negative.items():
            output.write_file(name, npy_bytes(embeddings[field_name]))

    def write_shard_counts(self, output: Any, counts: Mapping[str, int]) -> None:
        """``shard_counts.json``: every committed shard's basename -> its samples (empty shards too: a tar the
        loader lists must be in it)."""
        if self.shard_counts:
            output.write_file(contract.SHARD_COUNTS_JSON, json_file_bytes(dict(sorted(counts.items()))))


def layout_for(output: Any, negative_prompt: str | None, encoding: str, presets: Mapping[str, LayoutPreset] | None,
               fields: Sequence[str], *, scores: bool = False) -> Layout:
    """The layout of a run: ``output.layout`` (a preset of the encoding) or ``output.key_map`` over ``fields``
    (the encoding's fields for this plan). ``presets`` None: the encoding's member names cannot change.
    ``scores``: the meta holds score fields (``--score-column``), so a preset writes ``meta.json`` as the ``json``
    member, the one FastGen's ``presets_filter`` reads."""
    renamed = output.layout != contract.LAYOUT_ENERGON or bool(output.key_map)
    if renamed and presets is None:
        raise ConfigError(f"the {encoding} encoding keeps its member names ({', '.join(fields)}): remove "
                          f"--layout {output.layout} / --key-map (output.layout, output.key_map)")
    if output.layout != contract.LAYOUT_ENERGON:
        preset = (presets or {}).get(output.layout)
        if preset is None:
            raise ConfigError(f"layout {output.layout!r} is not defined for the {encoding} encoding; its layouts: "
                              f"{', '.join([contract.LAYOUT_ENERGON, *(presets or {})])}")
        held = {name for names in preset.members.values() for name in names}
        members = {m: names for m, names in preset.members.items() if all(n in fields for n in names)}
        members |= {f: (f,) for f in fields if f not in held}
        if scores and members.get(contract.META) == (contract.META,):
            del members[contract.META]
            members[contract.SCORE_JSON] = (contract.META,)
        if negative_prompt is not None and not preset.negative:
            raise ConfigError(f"model.negative_prompt (--negative-prompt) is written only by a layout with a negative "
                              f"prompt file; layout {output.layout!r} has none: remove it")
        negative = negative_prompt if negative_prompt is not None else ""
        return Layout(output.layout, members, negative if preset.negative else None, dict(preset.negative),
                      preset.shard_counts)
    if negative_prompt is not None:
        raise ConfigError("model.negative_prompt (--negative-prompt) is written only by a layout with a negative "
                          "prompt file: add --layout fastgen, or remove it")
    if not output.key_map:
        return Layout()
    return Layout(contract.LAYOUT_ENERGON, key_map_members(output.key_map, fields))


def key_map_members(key_map: Mapping[str, str], fields: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """member -> (field,) for every field, the ``key_map`` entries (field stem or name -> member name) applied.

    Refused, naming the entry and the valid fields: an unknown field, a name
    with a dot before its extension or another extension than the field's, and
    two fields under one name.
    """
    by_stem = {contract.field_stem(f): f for f in fields}
    valid = f"valid fields: {', '.join(by_stem)}"
    member_of = {f: f for f in fields}
    entry_of: dict[str, str] = {}
    for name, target in key_map.items():
        entry = f"{name}={target}"
        field_name = by_stem.get(name) or (name if name in fields else None)
        if field_name is None:
            raise ConfigError(f"key_map entry {entry!r}: {name!r} is not a field of this dataset; {valid}")
        extension = field_name.rpartition(".")[2]
        stem, dot, ending = target.rpartition(".")
        if not dot:
            stem, ending = "", target
        if ending != extension:
            raise ConfigError(f"key_map entry {entry!r}: the name must end in the field's extension .{extension} "
                              f"(it picks the decoder), e.g. {contract.field_stem(field_name)}.{extension}; {valid}")
        if "." in stem:
            raise ConfigError(f"key_map entry {entry!r}: {target!r} has a dot before its extension; a loader takes "
                              f"the member's extension from the first dot, so use one dot only; {valid}")
        if stem and not _MEMBER_STEM.match(stem):
            raise ConfigError(f"key_map entry {entry!r}: {stem!r} may hold only letters, digits, '_' and '-'; {valid}")
        member_of[field_name] = target
        entry_of[field_name] = entry
    seen: dict[str, str] = {}
    for field_name, member in member_of.items():
        if member in seen:
            both = [entry_of.get(f, f"the field {f} under its own name") for f in (seen[member], field_name)]
            raise ConfigError(f"key_map writes two fields as {member!r}: {both[0]} and {both[1]}; give each its own "
                              f"name; {valid}")
        seen[member] = field_name
    return {member: (field_name,) for member, field_name in seen.items()}


__all__ = ["Layout", "LayoutPreset", "key_map_members", "layout_for"]
