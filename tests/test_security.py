"""Security: tensor files are never unpickled, Hugging Face tokens never leave their file.

- Every ``.pth`` diffprep reads is loaded with ``torch.load(weights_only=True)``:
  a pickle bomb planted in an existing output is reported by the resume check
  and by validation, and never runs. A static scan of the sources keeps it so.
- A token file readable by others is refused; a token given through a mode-600
  file to a full library run (fetch, sanity, encode, audit, finalize, validate)
  appears in no file of the output, no log record, and not in the error of a
  refused download.

Hub downloads are served by test_hub's stand-in for ``snapshot_download``.
"""

from __future__ import annotations

import ast
import io
import logging
import traceback
from pathlib import Path

import huggingface_hub
import pytest
import torch

from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.writer.cooker import SampleLoadError, load_tensor
from diffprep.encodings.preencoded import preencoded_fields, sanity_check, write_empty_prompt
from diffprep.run.units import encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.families.hub import resolve_token
from diffprep.run.energon import finalize
from diffprep.errors import AuthError, ConfigError, DatasetValidationError, ExistingOutputError
from diffprep.phases.existing import decide, inspect_output
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.writer.plan import write_plan
from diffprep.writer.shards import ShardWriter, UnitManifest, write_manifest
from diffprep.validation import validate_dataset
from test_hub import REPO, FakeHub, _hub_error, _raising
from test_validate import pickle_bomb_pth

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("diffprep", "tasks", "flows", "blocks")
TOKEN = "hf_PLANTEDsecret1234567890"


# --- pickle bombs in an existing output --------------------------------------------------------------


def write_unit_with_bomb(out: Path, plan, marker: Path) -> None:
    """Commit unit 0 with the plan's shapes, except that its first sample's latents.pth is a pickle bomb."""
    keys = []
    with ShardWriter(out, 0) as writer:
        for index, source_id in enumerate(plan.unit(0).source_ids):
            key = contract.sample_key(0, index)
            fields: dict = {name: torch.zeros(plan.expected[contract.field_stem(name)])
                            for name in contract.TENSOR_FIELDS}
            if index == 0:
                fields[contract.LATENTS] = pickle_bomb_pth(marker)
            fields[contract.CAPTION] = f"caption of {source_id}"
            fields[contract.META] = {"source_id": source_id}
            writer.write(key, fields)
            keys.append(key)
        info = writer.commit()
    write_manifest(out, UnitManifest(unit=0, shard=info.name, fingerprint=plan.fingerprint, keys=keys,
                                     source_ids=list(plan.unit(0).source_ids), count=info.count, bytes=info.bytes,
                                     sha256=info.sha256))


@pytest.fixture
def bombed_output(tmp_path: Path, make_plan, write_unit):
    """A finalized output of two units whose first shard's first latents.pth runs ``mkdir(marker)`` when unpickled."""
    proof = tmp_path / "proof"
    torch.load(io.BytesIO(pickle_bomb_pth(proof)), weights_only=False)
    assert proof.is_dir()  # the payload is real: an unrestricted load runs it

    out, marker = tmp_path / "out", tmp_path / "pwned"
    plan = make_plan((2, 2))
    write_plan(out, plan)
    write_unit_with_bomb(out, plan, marker)
    write_unit(out, plan, 1)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    return out, plan, marker


def test_resume_check_reports_a_pickle_bomb_without_running_it(bombed_output) -> None:
    out, plan, marker = bombed_output

    inspection = inspect_output(out, plan)

    assert not marker.exists()
    assert inspection.same_settings and inspection.units_done == [0, 1]
    assert inspection.shape_problem is not None
    assert inspection.shape_problem.startswith("000000.tar:000000_000000 cannot be read (")
    assert not inspection.matches  # never resumed silently over it: someone must choose
    with pytest.raises(ExistingOutputError, match="do not match this run's shapes"):
        decide(inspection, None)
    with pytest.raises(ExistingOutputError, match="cannot resume"):
        decide(inspection, "resume")
    assert not marker.exists()


def test_resume_check_names_the_field_and_does_not_advise_unpickling(bombed_output) -> None:
    out, plan, _ = bombed_output
    problem = inspect_output(out, plan).shape_problem.replace("`", "")
    assert "latents.pth" in problem and "weights_only=True" in problem
    assert "weights_only set to False will likely succeed" not in problem


def test_validation_fails_on_a_pickle_bomb_without_running_it(bombed_output) -> None:
    out, _, marker = bombed_output

    report = validate_dataset(out, full=True)  # the bomb is in one sample: --full loads it (the default one per shard)

    assert not marker.exists()
    assert not report.ok
    failed = {check.name: check.detail for check in report.checks if not check.ok}
    assert list(failed) == ["load train"]
    assert "sample '000000_000000' field 'latents.pth' is not a plain tensor file" in failed["load train"]
    assert "never load it with weights_only=False" in failed["load train"]
    assert not (out / contract.STATE_DIR / contract.LATENT_STATS).exists()
    with pytest.raises(DatasetValidationError, match="load train"):
        report.raise_if_failed()
    with pytest.raises(SampleLoadError, match="not a plain tensor file"):
        load_tensor(pickle_bomb_pth(marker), key="k", field=contract.LATENTS)
    assert not marker.exists()


# --- static scan: no unrestricted unpickling in the sources ------------------------------------------


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of every deserialization that can run code: ``torch.load`` without a literal
    ``weights_only=True`` (also when imported under another name or given ``**kwargs``), any
    ``weights_only=False``, and ``pickle`` / ``dill`` / ``cloudpickle`` ``load``/``loads``."""
    tree = ast.parse(source, filename)
    torch_modules = {"torch"}
    torch_loads: set[str] = set()
    pickle_modules = {"pickle", "dill", "cloudpickle", "_pickle"}
    pickle_loads: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("torch", "torch.serialization"):
                    torch_modules.add(alias.asname or alias.name)
                if alias.name in pickle_modules:
                    pickle_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module in ("torch", "torch.serialization") and alias.name == "load":
                    torch_loads.add(alias.asname or alias.name)
                if node.module in pickle_modules and alias.name in ("load", "loads", "Unpickler"):
                    pickle_loads.add(alias.asname or alias.name)

    def dotted(func: ast.expr) -> str:
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return f"{dotted(func.value)}.{func.attr}"
        return ""

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "weights_only":
            if not (isinstance(node.value, ast.Constant) and node.value.value is True):
                found.append(f"{filename}:{node.value.lineno}: weights_only is not the literal True")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        module, _, attr = name.rpartition(".")
        is_torch_load = name in torch_loads or (
            attr == "load" and (module in torch_modules or module.endswith("serialization"))
        )
        if is_torch_load:
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            spread = any(k.arg is None for k in node.keywords)
            if spread or not weights_only or not (
                isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True
            ):
                found.append(f"{filename}:{node.lineno}: {name}(...) without weights_only=True")
        if name in pickle_loads or (attr in ("load", "loads", "Unpickler") and module in pickle_modules):
            found.append(f"{filename}:{node.lineno}: {name}(...) unpickles arbitrary objects")
    return found


@pytest.mark.parametrize(
    "snippet, flagged",
    [
        ("import torch\ntorch.load(f, weights_only=True, map_location='cpu')", False),
        ("import torch\ntorch.load(f)", True),
        ("import torch\ntorch.load(f, weights_only=False)", True),
        ("import torch\ntorch.load(f, weights_only=flag)", True),
        ("import torch\ntorch.load(f, **options)", True),
        ("import torch as t\nt.load(f, map_location='cpu')", True),
        ("from torch import load as read\nread(f)", True),
        ("import torch\ntorch.serialization.load(f)", True),
        ("import pickle\npickle.loads(data)", True),
        ("from pickle import load\nload(f)", True),
        ("import json\njson.load(f)", False),
        ("import yaml\nyaml.safe_load(f)", False),
    ],
)
def test_the_scan_finds_unrestricted_loads(snippet: str, flagged: bool) -> None:
    assert bool(unsafe_loads(snippet)) is flagged


def test_no_source_file_unpickles_without_weights_only() -> None:
    files = sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))
    assert any(path.name == "existing.py" for path in files) and any(path.name == "cooker.py" for path in files)
    found = [hit for path in files for hit in unsafe_loads(path.read_text(encoding="utf-8"),
                                                          str(path.relative_to(ROOT)))]
    assert found == []
    # The scan sees the load that exists: shards.load_tensor, which the resume check and the cooker use.
    loads = {path.name for path in files if "torch.load(" in path.read_text(encoding="utf-8")}
    assert "shards.py" in loads


# --- tokens ----------------------------------------------------------------------------------------


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "secrets" / "hf_token"
    path.parent.mkdir()
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the planted token may be found: the developer's own must not be sent or searched for.
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666, 0o601])
def test_token_file_accessible_to_others_is_refused(token_file: Path, mode: int) -> None:
    token_file.chmod(mode)
    with pytest.raises(ConfigError) as info:
        resolve_token(token_file)
    assert f"mode {mode:03o}" in str(info.value) and "chmod 600" in str(info.value)
    assert TOKEN not in str(info.value)
    assert TOKEN not in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_token_file_for_the_owner_only_is_read(token_file: Path, mode: int) -> None:
    token_file.chmod(mode)
    assert resolve_token(token_file) == TOKEN


def files_holding(root: Path, secret: str) -> list[str]:
    needle = secret.encode()
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")
                  if path.is_file() and needle in path.read_bytes())


def test_planted_token_never_reaches_files_logs_or_output(
    tmp_path: Path, tiny_model: Path, demo_data: Path, settings_for, token_file: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture,
) -> None:
    # The encoders come from a "hub repo" served from the tiny model, so the token is really sent.
    hub = FakeHub(tmp_path / "hub-cache", {REPO: tiny_model})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    settings = settings_for(out, demo_data, REPO, auth={"hf_token_file": str(token_file)})

    plan, source = fetch(settings)
    write_plan(out, plan)
    encoders = FluxEncoders.load(settings.model, token=resolve_token(settings.auth.hf_token_file))
    spec = ImageSpec.from_config(settings.image)
    sanity_check(out, plan, encoders, source, spec, batch_size=settings.model.batch_size)
    write_empty_prompt(out, encoders)
    for unit in plan.units:
        encode_unit(out, plan, unit.unit, preencoded_fields(encoders), source, spec,
                    batch_size=settings.model.batch_size)
    report = audit(out, plan)
    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.5)
    validation = validate_dataset(out)

    assert hub.calls and all(call["token"] == TOKEN for call in hub.calls)  # it did travel
    assert report.ok and (report.written, report.rejected) == (12, 0)
    assert validation.ok, validation.to_markdown()
    state = out / contract.STATE_DIR
    for name in (contract.PLAN_JSON, contract.AUDIT_JSON, contract.VALIDATION_JSON, contract.SPLITS_JSON,
                 contract.EMPTY_PROMPT, contract.LATENT_STATS, f"{contract.SANITY_DIR}/report.json",
                 f"{contract.UNITS_DIR}/000000.json"):
        assert (state / name).is_file(), name  # each artifact exists, so the search below covers it
    assert (out / contract.NV_META / contract.INDEX_SQLITE).is_file() and (out / "000002.tar.idx").is_file()

    assert files_holding(out, TOKEN) == []
    assert TOKEN not in settings.model_dump_json()  # what the flow passes as parameters
    assert caplog.records  # DEBUG capture was on
    assert not [r for r in caplog.records if TOKEN in r.getMessage() or TOKEN in repr(r.args)]
    captured = capfd.readouterr()
    assert TOKEN not in captured.out and TOKEN not in captured.err


def test_refused_download_error_never_holds_the_token(
    tmp_path: Path, demo_data: Path, settings_for, token_file: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(_hub_error(401, "GatedRepo")))
    caplog.set_level(logging.DEBUG)
    settings = settings_for(tmp_path / "out", demo_data, REPO, auth={"hf_token_file": str(token_file)})

    with pytest.raises(AuthError) as info:
        fetch(settings)

    message = str(info.value)
    assert message.startswith(f"VAE: the Hugging Face Hub refused the download from {REPO} (the repo is gated)")
    assert "A token was sent" in message
    assert TOKEN not in message and TOKEN not in repr(info.value)
    assert TOKEN not in "".join(traceback.format_exception(info.value))  # with its chained hub error
    assert not [r for r in caplog.records if TOKEN in r.getMessage() or TOKEN in repr(r.args)]
    assert not (tmp_path / "out").exists()
