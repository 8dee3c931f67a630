"""Shared fixtures: the tiny offline Flux model, the demo dataset, and small settings.

Everything here is built locally: nothing is downloaded, and the environment
keeps the libraries offline and silent before any of them is imported.
"""

from __future__ import annotations

import os

from diffprep.cli import prefect_defaults  # noqa: E402 - imports nothing heavy

# Set before diffusers, transformers, huggingface_hub or prefect are imported anywhere: the CLI's own
# defaults (offline, library log lines shipped to run logs), nothing downloaded, no warning when
# library code logs outside a flow run.
prefect_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

from pathlib import Path
from typing import Any, Callable

import pytest

import torch

from diffprep import contract
from diffprep.config import Settings, load_settings
from diffprep.tools.demo import write_demo_dataset
from diffprep.writer.plan import Plan, UnitPlan, fingerprint
from diffprep.writer.shards import Reject, ShardWriter, UnitManifest, write_manifest
from diffprep.families.flux_tiny import write_tiny_model

# Small values that keep an encode of the tiny model well under a second per unit.
SMALL_SETTINGS: dict[str, dict[str, Any]] = {
    "output": {"shard_size": 4},
    # min_psnr 0: the tiny model's random-weight VAE cannot reconstruct images (round trip about 8 dB).
    "model": {"precision": "fp32", "device": "cpu", "batch_size": 4, "t5_max_length": 16, "min_psnr": 0.0},
    "image": {"image_size": 32, "decode_workers": 1},
}


@pytest.fixture(autouse=True)
def _no_diffprep_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read ``DIFFPREP_*`` from the environment: a variable set in the shell must not change a test."""
    for name in list(os.environ):
        if name.startswith("DIFFPREP_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight encoder set in the FLUX.1-dev layout (written once per session; do not modify)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-flux")


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LTX-2 set (checkpoint + Gemma 3 folder), as `diffprep tiny-model --family ltx2` writes it (do not
    modify)."""
    from diffprep.families.ltx2_tiny import write_tiny_ltx2

    return write_tiny_ltx2(tmp_path_factory.mktemp("tiny") / "ltx2", seed=0)


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Wan set in its diffusers layout (written once per session; do not modify)."""
    from diffprep.families.wan_tiny import write_tiny_wan

    return write_tiny_wan(tmp_path_factory.mktemp("tiny") / "wan")


@pytest.fixture
def demo_data(tmp_path: Path) -> Path:
    """A fresh 12-sample directory source (images/ + captions/) that the test may change."""
    return write_demo_dataset(tmp_path / "demo", samples=12)


@pytest.fixture
def settings_for() -> Callable[..., Settings]:
    """``settings_for(out_dir, input_dir, model_path, **sections)`` -> small, explicit settings.

    A directory source at ``input_dir``, fp32 on the CPU, image_size 32,
    t5_max_length 16, batch_size 4, shard_size 4; ``sections`` are per-section
    overrides merged over those, e.g. ``image={"image_size": 64}``.
    """

    def make(
        out_dir: str | os.PathLike,
        input_dir: str | os.PathLike,
        model_path: str | os.PathLike,
        **sections: dict[str, Any],
    ) -> Settings:
        overrides: dict[str, dict[str, Any]] = {name: dict(values) for name, values in SMALL_SETTINGS.items()}
        overrides.setdefault("source", {}).update(type="directory", input_dir=str(input_dir))
        overrides["output"]["output_dir"] = str(out_dir)
        overrides["model"]["model_path"] = str(model_path)
        for section, values in sections.items():
            overrides.setdefault(section, {}).update(values)
        return load_settings(overrides=overrides)

    return make


# --- Hand-built outputs (no encoder): plans and finished units with real shards and manifests --------

# Shapes of the tiny model at image_size 32, t5_max_length 16 (what fetch() plans for it).
TINY_EXPECTED: dict[str, Any] = {"latents": [16, 4, 4], "prompt_embeds": [16, 32], "pooled_prompt_embeds": [32],
                                 "dtype": "float32"}


@pytest.fixture
def make_plan() -> Callable[..., Plan]:
    """``make_plan(sizes=(4, 4, 2), settings=None, expected=None)`` -> a Plan of ``len(sizes)`` units.

    Source ids are ``img0000.png``, ``img0001.png``...; the fingerprint is that of ``settings``.
    """

    def make(sizes=(4, 4, 2), *, settings: dict[str, Any] | None = None,
             expected: dict[str, Any] | None = None) -> Plan:
        settings = settings if settings is not None else {"shard_size": max(sizes, default=1), "test": True}
        units, start = [], 0
        for unit, size in enumerate(sizes):
            units.append(UnitPlan(unit, [f"img{i:04d}.png" for i in range(start, start + size)]))
            start += size
        return Plan(
            fingerprint=fingerprint(settings),
            settings=settings,
            source={"type": "directory", "input_dir": "/nowhere"},
            expected=dict(expected or TINY_EXPECTED),
            units=units,
        )

    return make


@pytest.fixture
def write_unit() -> Callable[..., UnitManifest]:
    """``write_unit(out_dir, plan, unit, rejects={source_id: reason}, shapes={field_stem: shape})``.

    Writes the unit's shard with the real ShardWriter (random tensors of the
    plan's shapes unless ``shapes`` overrides one) and commits its manifest.
    Rejected ids leave a gap in the keys, as the encoder does.
    """

    def write(out_dir: str | os.PathLike, plan: Plan, unit: int, *, rejects: dict[str, str] | None = None,
              shapes: dict[str, list[int]] | None = None) -> UnitManifest:
        rejects = rejects or {}
        shapes = {**plan.expected, **(shapes or {})}
        dtype = getattr(torch, plan.expected.get("dtype", "float32"))
        generator = torch.Generator().manual_seed(unit)
        keys, written = [], []
        with ShardWriter(out_dir, unit) as writer:
            for index, source_id in enumerate(plan.unit(unit).source_ids):
                if source_id in rejects:
                    continue
                key = contract.sample_key(unit, index)
                fields: dict[str, Any] = {
                    name: torch.randn(shapes[contract.field_stem(name)], generator=generator).to(dtype)
                    for name in contract.TENSOR_FIELDS
                }
                fields[contract.CAPTION] = f"caption of {source_id}"
                fields[contract.META] = {"source_id": source_id}
                writer.write(key, fields)
                keys.append(key)
                written.append(source_id)
            info = writer.commit()
        manifest = UnitManifest(
            unit=unit, shard=info.name, fingerprint=plan.fingerprint, keys=keys, source_ids=written,
            count=info.count, bytes=info.bytes, sha256=info.sha256,
            rejects=[Reject(sid, reason, f"test reject of {sid}") for sid, reason in rejects.items()],
        )
        write_manifest(out_dir, manifest)
        return manifest

    return write


# --- Prefect ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def prefect_server():
    """One real Prefect server for the session (a temporary SQLite database); sets PREFECT_API_URL."""
    # Imported here, at first use, and before any test captures output: Prefect's console log
    # handler keeps the stream it finds when it is set up.
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# --- a real S3 endpoint on loopback (tests/s3_store.py) ------------------------------------------------------


@pytest.fixture(scope="session")
def moto_port() -> int:
    """moto's S3 server on 127.0.0.1, one per session (buckets and prefixes keep tests apart)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()[1]
    server.stop()


@pytest.fixture(scope="session")
def proxy_server(moto_port: int):
    from s3_store import FaultProxy

    proxy = FaultProxy(moto_port)
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy(proxy_server):
    """The fault-injecting proxy in front of moto, its log and queued faults cleared."""
    proxy_server.reset()
    return proxy_server


@pytest.fixture(scope="module")
def admin(moto_port: int, request: pytest.FixtureRequest):
    """The test's own client, straight to moto (not through the proxy), with the module's ``BUCKET`` created."""
    from s3_store import admin_client

    client = admin_client(moto_port)
    client.create_bucket(Bucket=request.module.BUCKET)
    return client


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials from the environment, nothing from the machine's own AWS setup; a fresh staging folder."""
    from s3_store import ACCESS_KEY, REGION, SECRET_KEY

    for name in [n for n in os.environ if n.startswith(("AWS_", "MSC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("DIFFPREP_STAGING_DIR", str(tmp_path / "staging"))
