"""latent_mode "posterior": the raw VAE posterior next to the latents, as Primus's resample mode reads it.

Per sample ``mean.pth`` and ``logvar.pth`` [16, H/8, W/8] (diffusers' posterior,
no shift or scale, logvar clamped to [-30, 20]) and ``latents.pth`` =
``scale * (mean - shift)``; validation, the audit and the cooker know the two
extra fields.
"""

from __future__ import annotations

import io
import tarfile

import torch

from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.writer.cooker import cook_preencoded
from diffprep.families.flux import FluxEncoders
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.energon import finalize
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.writer.plan import write_plan
from diffprep.run.units import encode_unit
from diffprep.validation import validate_dataset


def test_posterior_mode_stores_mean_and_logvar_and_validates(tmp_path, demo_data, tiny_model, settings_for) -> None:
    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, model={"latent_mode": "posterior"})
    plan, source = fetch(settings)
    assert plan.expected["mean"] == plan.expected["logvar"] == plan.expected["latents"] == [16, 4, 4]
    assert plan.settings["encoders"]["latent_mode"] == "posterior"  # another fingerprint than sample or mode
    write_plan(out, plan)
    encoders = FluxEncoders.load(settings.model)
    for unit in plan.units:
        encode_unit(out, plan, unit.unit, preencoded_fields(encoders), source, ImageSpec.from_config(settings.image),
                    batch_size=4, decode_workers=1)
    report = audit(out, plan)
    assert report.ok and report.written == 12, report.problems

    with tarfile.open(out / "000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    key = contract.sample_key(0, 0)
    sample = {"__key__": key, "__restore_key__": (), "__subflavors__": {}, "__sources__": ()}
    sample |= {name[len(key) + 1:]: data for name, data in members.items() if name.startswith(key + ".")}
    assert set(sample) >= {contract.LATENTS, contract.MEAN, contract.LOGVAR}
    # Primus's cook_preencoded (consumer-formats.md C): each member through a bare torch.load (weights only by
    # default on torch >= 2.6); it needs latents or mean. (Its CFG files: test_cli's end-to-end test.)
    bare = {name: torch.load(io.BytesIO(sample[name]))
            for name in (*contract.TENSOR_FIELDS, *contract.POSTERIOR_FIELDS)}
    assert {name: tuple(t.shape) for name, t in bare.items()} == {
        contract.LATENTS: (16, 4, 4), contract.PROMPT_EMBEDS: (16, 32), contract.POOLED_PROMPT_EMBEDS: (32,),
        contract.MEAN: (16, 4, 4), contract.LOGVAR: (16, 4, 4)}
    cooked = cook_preencoded(sample)
    vae = encoders.vae.config
    assert cooked.mean.shape == cooked.logvar.shape == cooked.latents.shape == (16, 4, 4)
    assert torch.equal(cooked.latents, (cooked.mean - vae.shift_factor) * vae.scaling_factor)
    assert float(cooked.logvar.min()) >= -30.0 and float(cooked.logvar.max()) <= 20.0
    # The posterior is the VAE's own: diffusers' distribution of the same prepared image, unnormalized (up to the
    # last bits: a batch of one takes other CPU kernels than the unit's batch of four).
    spec = ImageSpec.from_config(settings.image)
    image = prepare_image((demo_data / "images" / plan.units[0].source_ids[0]).read_bytes(), spec)
    with torch.no_grad():
        dist = encoders.vae.encode(2.0 * (image.pixels[None].float() / 255.0) - 1.0).latent_dist
    torch.testing.assert_close(cooked.mean, dist.mean[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cooked.logvar, dist.logvar[0], rtol=1e-4, atol=1e-5)
    # What Primus does with them each step: a fresh draw, then its own shift and scale.
    draw = vae.scaling_factor * (cooked.mean + torch.exp(0.5 * cooked.logvar) * torch.randn(16, 4, 4)
                                 - vae.shift_factor)
    assert draw.shape == cooked.latents.shape and torch.isfinite(draw).all()

    finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    validation = validate_dataset(out)
    assert validation.ok, validation.to_markdown()
    assert set(validation.summary["fields"]) == {"latents", "prompt_embeds", "pooled_prompt_embeds", "mean", "logvar"}

    # A sample without its logvar is caught by the audit and by validation.
    _drop_member(out / "000001.tar", f"{contract.sample_key(1, 0)}.{contract.LOGVAR}")
    assert any("missing fields" in problem for problem in audit(out, plan).problems)
    failed = {check.name: check.detail for check in validate_dataset(out, previews=0).failed()}
    assert "missing ['logvar.pth']" in failed["fields"]


def _drop_member(shard, name: str) -> None:
    with tarfile.open(shard) as tar:
        kept = [(m, tar.extractfile(m).read()) for m in tar if m.name != name]
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in kept:
            tar.addfile(member, io.BytesIO(data))
