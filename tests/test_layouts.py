"""Output layouts (``--layout``, ``--key-map``) read the way the trainers read them.

Written from ``../shared/reference/consumer-formats.md`` section B (NVIDIA
FastGen), no trainer code: webdataset's ``Decoder`` over the key map's values
only, members matched by their whole extension, the sample key the member
name before its first dot, torch's ``default_collate`` turning the Flux tuple
into a list; the negative prompt through ``np.load``, found by a relative
``files_map`` path joined to the datatag's dirname; ``shard_counts.json`` as
the deterministic loader reads it. The same folder is still an Energon
dataset: validation loads it through diffprep's cooker.
"""

from __future__ import annotations

import json
import os
import tarfile

import numpy as np
import pytest
import torch
import webdataset.autodecode
from torch.utils.data import default_collate

from conftest import TINY_EXPECTED
from fastgen_loader import fastgen_samples
from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.config import load_settings
from diffprep.validation.decode import decode_dataset
from diffprep.families.flux import FluxEncoders
from diffprep.encodings import get_encoding
from diffprep.run.energon import read_subflavors
from diffprep.errors import ConfigError
from diffprep.phases.existing import inspect_output
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.writer.layouts import Layout, layout_for
from diffprep.phases.pipeline import run
from diffprep.writer.plan import fingerprint, read_plan
from diffprep.writer.shards import read_manifests
from diffprep.validation import validate_dataset
from test_posterior import _drop_member

NEGATIVE = "blurry, low quality"


def _keys_per_tar(out) -> dict[str, int]:
    counts = {}
    for path in sorted(out.glob("*.tar")):
        with tarfile.open(path) as tar:
            counts[path.name] = len({m.name.partition(".")[0] for m in tar if m.isfile()})
    return counts


def test_fastgen_flux_output_reads_like_fastgens_latent_loader(tmp_path, demo_data, tiny_model, settings_for,
                                                              monkeypatch) -> None:
    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"layout": "fastgen"},
                            model={"latent_mode": "mode", "negative_prompt": NEGATIVE}, finalize={"train_split": 1.0})
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    # Still an Energon dataset: validation loaded every sample through the cooker, which reads dataset.yaml's map.
    assert result.samples == 12 and result.validation["ok"]
    assert set(result.validation["summary"]["fields"]) == {"latents", "prompt_embeds", "pooled_prompt_embeds"}
    recorded = read_subflavors(out)["layout"]  # dataset.yaml, as plan.json
    assert recorded == read_plan(out).settings["layout"] and recorded["name"] == "fastgen"
    assert recorded["members"][contract.FASTGEN_TXT_EMB] == [contract.POOLED_PROMPT_EMBEDS, contract.PROMPT_EMBEDS]

    monkeypatch.setattr(webdataset.autodecode, "pytorch_weights_only", True)
    key_map = {"real": contract.FASTGEN_LATENT, "condition": contract.FASTGEN_TXT_EMB}
    samples = fastgen_samples(out, key_map)
    manifests = read_manifests(out)
    assert [s["__key__"] for s in samples] == [k for m in manifests.values() for k in m.keys]
    first = samples[0]
    assert isinstance(first[contract.CAPTION], bytes)  # not in the key map: left undecoded
    assert contract.LATENTS not in first and contract.PROMPT_EMBEDS not in first
    pooled, t5 = first[contract.FASTGEN_TXT_EMB]  # the tuple Flux's network unpacks: (pooled, t5)
    assert (tuple(first[contract.FASTGEN_LATENT].shape), tuple(pooled.shape), tuple(t5.shape)) == (
        (16, 4, 4), (32,), (16, 32))

    # The values the network expects: latents (mode - shift) * scale, as its VAE wrapper makes them; the
    # caption's own embeddings (up to the last bits: a batch of one takes other CPU kernels than the unit's four).
    encoders = FluxEncoders.load(settings.model)
    meta = json.loads(tarfile.open(out / "000000.tar").extractfile(f"{first['__key__']}.meta.json").read())
    source = (demo_data / "images" / meta["source_id"]).read_bytes()
    image = prepare_image(source, ImageSpec.from_config(settings.image))
    vae = encoders.vae
    with torch.no_grad():
        mode = vae.encode(2.0 * (image.pixels[None].float() / 255.0) - 1.0).latent_dist.mode()[0]
    torch.testing.assert_close(first[contract.FASTGEN_LATENT],
                               (mode - vae.config.shift_factor) * vae.config.scaling_factor, rtol=1e-4, atol=1e-5)
    caption = (demo_data / "captions" / (meta["source_id"].rsplit(".", 1)[0] + ".txt")).read_text().strip()
    text = encoders.encode_text([caption])
    torch.testing.assert_close(pooled, text.pooled_prompt_embeds[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(t5, text.prompt_embeds[0], rtol=1e-4, atol=1e-5)

    # default_collate: tensors stacked, the tuple a list (so FastGen needs enable_preprocessors=False).
    batch = default_collate([{name: s[member] for name, member in key_map.items()} for s in samples[:4]])
    assert batch["real"].shape == (4, 16, 4, 4)
    assert isinstance(batch["condition"], list)
    assert [tuple(t.shape) for t in batch["condition"]] == [(4, 32), (4, 16, 32)]

    # files_map={"neg_condition": "neg_prompt_emb.npy"}: a relative path joined to dirname of WDS:<out>/ = <out>.
    root = os.path.dirname(f"{out}/")
    negative = np.load(os.path.join(root, contract.NEG_PROMPT_EMB), allow_pickle=False)
    negative_pooled = np.load(os.path.join(root, contract.NEG_POOLED_PROMPT_EMB), allow_pickle=False)
    assert (negative.dtype, negative.shape, negative_pooled.dtype, negative_pooled.shape) == (
        np.float32, (16, 32), np.float32, (32,))  # one sample, no batch dimension
    said = encoders.encode_text([NEGATIVE])
    torch.testing.assert_close(torch.from_numpy(negative), said.prompt_embeds[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(negative_pooled), said.pooled_prompt_embeds[0], rtol=1e-4, atol=1e-5)

    # shard_counts.json: keyed by the *.tar basenames in the datatag folder, counts = the samples in each.
    counts = json.loads((out / contract.SHARD_COUNTS_JSON).read_text())
    assert counts == _keys_per_tar(out) == {"000000.tar": 4, "000001.tar": 4, "000002.tar": 4}

    # decode reads the layout's members back to pictures.
    decoded = decode_dataset(out, 2, device="cpu", local_only=True)
    assert [tuple(p.decoded.shape) for p in decoded.previews] == [(3, 32, 32)] * 2

    # A re-run reads the first sample back under the layout (shapes against the plan): nothing to do; the
    # tuple's T5 sequence is what it compares.
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}")).action == "complete"
    other = read_plan(out)
    other.expected["prompt_embeds"] = [16, 99]
    assert "prompt_embeds.pth has shape [16, 32], this run writes [16, 99]" in inspect_output(out, other).shape_problem

    # Audit and validation follow the members written: a sample without its txt_emb.pth is caught by both.
    _drop_member(out / "000001.tar", f"{contract.sample_key(1, 0)}.{contract.FASTGEN_TXT_EMB}")
    assert any("missing fields" in p for p in audit(out, read_plan(out)).problems)
    failed = {check.name: check.detail for check in validate_dataset(out, previews=0).failed()}
    assert "missing ['prompt_embeds.pth', 'pooled_prompt_embeds.pth']" in failed["fields"]
    assert "layout fastgen: it has the members ['caption.txt', 'latent.pth', 'meta.json']" in failed["fields"]


def test_key_map_renames_fields_and_refuses_what_a_loader_cannot_read(tmp_path, tiny_model, settings_for) -> None:
    encoding = get_encoding("preencoded")
    plain = encoding.planned(settings_for(tmp_path, tmp_path, tiny_model), None)[0]
    assert "layout" not in plain  # energon's own names: the plan (and fingerprint) as before layouts existed

    mapped = settings_for(tmp_path, tmp_path, tiny_model,
                          output={"key_map": "latents=latent.pth,prompt_embeds=txt_emb.pth"})
    byte, expected = encoding.planned(mapped, None)
    assert fingerprint(byte) != fingerprint(plain)
    layout = Layout.of_plan(byte)
    fields = {contract.LATENTS: torch.ones(2), contract.PROMPT_EMBEDS: torch.zeros(3),
              contract.POOLED_PROMPT_EMBEDS: torch.zeros(1), contract.CAPTION: "a cat", contract.META: {}}
    written = layout.write(fields)
    assert sorted(written) == sorted(["latent.pth", "txt_emb.pth", contract.POOLED_PROMPT_EMBEDS, contract.CAPTION,
                                      contract.META])
    assert layout.read(written) == fields and layout.fields_of(written) == list(fields)

    def refused(key_map: str, match: str) -> None:
        settings = settings_for(tmp_path, tmp_path, tiny_model, output={"key_map": key_map})
        with pytest.raises(ConfigError, match=match):
            encoding.planned(settings, None)

    valid = "valid fields: latents, prompt_embeds, pooled_prompt_embeds, caption, meta"
    refused("latent=latent.pth", f"entry 'latent=latent.pth': 'latent' is not a field.*{valid}")
    refused("latents=x.pth,prompt_embeds=x.pth",
            f"two fields as 'x.pth': latents=x.pth and prompt_embeds=x.pth.*{valid}")
    refused("latents=pooled_prompt_embeds.pth", "two fields as 'pooled_prompt_embeds.pth'.*under its own name")
    refused("latents=my.latent.pth", f"'my.latent.pth' has a dot before its extension.*{valid}")
    refused("latents=latent.npy", f"must end in the field's extension .pth.*{valid}")
    with pytest.raises(ConfigError, match="entries must be field=name"):
        load_settings(overrides={"output": {"key_map": "latents"}})
    with pytest.raises(ConfigError, match="preset key map: pass it or key_map, not both"):
        load_settings(overrides={"output": {"layout": "fastgen", "key_map": "latents=latent.pth"}})

    fastgen = load_settings(overrides={"output": {"layout": "fastgen"}}).output
    # The raw encoding's one layout is EDM's archive (its files keep their names in the shards).
    with pytest.raises(ConfigError, match="layout 'fastgen' is not defined for the raw encoding; its layouts: "
                       "energon, edm-zip"):
        layout_for(fastgen, None, "raw", get_encoding("raw").layout_presets, ["jpg", "txt", "meta.json"])
    with pytest.raises(ConfigError, match="negative_prompt.*add --layout fastgen"):
        layout_for(load_settings().output, "ugly", "preencoded", encoding.layout_presets,
                   encoding.required_fields(TINY_EXPECTED))
    # Each encoding offers its own layouts: FastGen reads no LTX-2 data, and only LTX-2 has the trainer's folders.
    ltx = load_settings(overrides={"output": {"layout": "ltx"}}).output
    with pytest.raises(ConfigError, match="layout 'ltx' is not defined for the preencoded encoding; its layouts: "
                                          "energon, fastgen"):
        layout_for(ltx, None, "preencoded", encoding.layout_presets, encoding.required_fields(TINY_EXPECTED))
    ltx2 = get_encoding("ltx2")
    with pytest.raises(ConfigError, match="layout 'fastgen' is not defined for the ltx2 encoding; its layouts: "
                                          "energon, ltx"):
        layout_for(fastgen, None, "ltx2", ltx2.layout_presets, [contract.LATENTS, contract.CAPTION])
    assert layout_for(ltx, None, "ltx2", ltx2.layout_presets, [contract.LATENTS]).name == contract.LAYOUT_LTX
    with pytest.raises(ConfigError, match="negative_prompt.*layout 'ltx' has none: remove it"):
        layout_for(ltx, "ugly", "ltx2", ltx2.layout_presets, [contract.LATENTS])
