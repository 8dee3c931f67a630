"""Latent statistics (diffprep/report/latent_stats.py): merged moments equal the direct computation, the whitening is
cov^-1/2, and `diffprep latent-stats` reproduces, from the stored shards, what validation saved."""

from __future__ import annotations

import json

import pytest
import torch

from diffprep import contract
from diffprep.report.checks import Check
from diffprep.report.latent_stats import EIGEN_FLOOR, LatentStats
from diffprep.writer.shards import load_tensor
from diffprep.validation import validate_dataset
from diffprep.report.validation import ValidationReport
from flow_runs import shard_samples
from latent_direct import close32, direct


def test_merged_parts_equal_the_direct_statistics() -> None:
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(4, 4, generator=generator)  # correlated channels
    latents = [(mixing @ torch.randn(4, 6 * (i + 1), generator=generator)).reshape(4, 2, -1) + i for i in range(7)]
    mean, std, cov = direct(latents)

    whole = LatentStats(full_cov=True)
    for x in latents:
        whole.add(x)
    # Units of two workers and a resumed run: parts merged in another order.
    parts = [LatentStats(full_cov=True) for _ in range(3)]
    for i, x in enumerate(latents):
        parts[i % 3].add(x)
    merged = LatentStats(full_cov=True)
    for part in reversed(parts):
        merged.merge(part)

    # The float64 math, before the cast to the file's float32.
    for stats in (whole.result(torch.float64), merged.result(torch.float64)):
        assert torch.allclose(stats["mean"], mean, atol=1e-12) and torch.allclose(stats["std"], std, atol=1e-12)
        assert torch.allclose(stats["cov"], cov, atol=1e-10)
        assert int(stats["count"]) == sum(x[0].numel() for x in latents) and int(stats["samples"]) == 7
        identity = torch.eye(4, dtype=torch.float64)
        assert torch.allclose(stats["whiten"] @ stats["cov"] @ stats["whiten"], identity, atol=1e-8)
        assert torch.allclose(stats["unwhiten"] @ stats["whiten"], identity, atol=1e-8)
        assert torch.allclose(stats["whiten"], stats["whiten"].T)  # ZCA: symmetric
        eigenvalues = torch.linalg.eigvalsh(cov)
        assert float(stats["condition"]) == pytest.approx(float(eigenvalues.max() / eigenvalues.min()), rel=1e-8)
    # What is saved: float32 (GAE's dtype), the float64 numbers rounded; the counts int64.
    saved, exact = merged.result(), merged.result(torch.float64)
    assert sorted(saved) == sorted(exact)
    for name in ("mean", "std", "cov", "whiten", "unwhiten", "condition"):
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], exact[name].float()), name
    assert saved["count"].dtype == saved["samples"].dtype == torch.int64


def test_a_constant_channel_is_floored_not_infinite() -> None:
    stats = LatentStats(full_cov=True)
    stats.add(torch.stack([torch.arange(8.0), torch.zeros(8)]))
    result = stats.result()
    assert torch.isfinite(result["whiten"]).all()
    assert float(result["whiten"][1, 1]) == pytest.approx(EIGEN_FLOOR ** -0.5)
    assert float(result["condition"]) == pytest.approx(float(result["cov"][0, 0]) / EIGEN_FLOOR)


def test_without_full_cov_the_result_is_per_channel_only_and_channels_must_agree() -> None:
    stats = LatentStats()
    stats.add(torch.ones(3, 2, 2))
    assert sorted(stats.result()) == ["count", "mean", "samples", "std"]
    with pytest.raises(ValueError, match="4 channels cannot join statistics of 3"):
        stats.add(torch.ones(4, 2, 2))


@pytest.mark.slow
def test_the_command_reproduces_validation_from_every_stored_latent(tmp_path, demo_data, tiny_model,
                                                                    settings_for, capsys) -> None:
    from diffprep.cli import main
    from diffprep.phases.pipeline import run

    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"shard_size": 3}, finalize={"train_split": 1.0})
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).samples == 12
    saved = torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)
    # By default too, each unit saved its per-channel moments (no co-moments) and finalize merged them.
    units = sorted((out / contract.STATE_DIR / contract.UNIT_STATS_DIR).iterdir())
    assert [p.name for p in units] == [f"{u:06d}.pt" for u in range(4)]
    assert all(sorted(torch.load(p, weights_only=True)["fields"][contract.LATENTS]) == ["count", "m2", "mean",
                                                                                        "samples"] for p in units)

    latents = [load_tensor(fields[contract.LATENTS]) for fields in shard_samples(out).values()]
    assert len(latents) == 12
    mean, std, cov = direct(latents)
    path = tmp_path / "stats.pt"
    assert main(["latent-stats", str(out), "--full-cov", "--output", str(path)]) == 0
    assert f"latent statistics of 12 samples ({12 * 4 * 4} values per channel, 16 channels" in capsys.readouterr().out
    computed = torch.load(path, weights_only=True)
    assert close32(computed["mean"], mean) and close32(computed["std"], std) and close32(computed["cov"], cov)
    # The units' merge: the same numbers as every stored latent's, at once or one by one (to float32 precision).
    assert sorted(saved) == ["count", "mean", "samples", "std"]
    assert close32(saved["mean"], mean) and close32(saved["std"], std)
    # The run's validation loaded one sample per shard; the statistics it reports are the file's, of all 12.
    reported = json.loads((out / contract.STATE_DIR / contract.VALIDATION_JSON).read_text())["summary"]
    assert reported["loaded"]["samples"] == 4 and reported["latent_stats"]["samples"] == 12
    assert reported["latent_stats"]["mean"] == saved["mean"].tolist()
    for name in ("mean", "std"):
        assert close32(computed[name], saved[name]), name
    assert torch.equal(computed["count"], saved["count"]) and torch.equal(computed["samples"], saved["samples"])
    # Without --output, into the dataset's state folder (per channel only).
    assert main(["latent-stats", str(out)]) == 0
    assert sorted(torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)) == sorted(saved)

    # Richer statistics are never replaced by poorer ones unless asked: over a file with the covariance, the
    # command without --full-cov computes it again, and a re-validation (whose units saved no co-moments) keeps it.
    stats_file = out / contract.STATE_DIR / contract.LATENT_STATS
    assert main(["latent-stats", str(out), "--full-cov"]) == 0
    capsys.readouterr()
    assert main(["latent-stats", str(out)]) == 0
    assert "with the full covariance, as the file it replaces held it" in capsys.readouterr().out
    again = torch.load(stats_file, weights_only=True)
    assert close32(again["cov"], cov) and close32(again["whiten"], computed["whiten"])
    report = validate_dataset(out, previews=0)
    assert report.ok and "computed again with it" in {c.name: c.detail for c in report.checks}[
        "latent stats with the covariance"]
    after = torch.load(stats_file, weights_only=True)
    assert close32(after["cov"], cov) and close32(after["mean"], mean)
    # Asked for (--no-full-cov): per channel only.
    assert main(["latent-stats", str(out), "--no-full-cov"]) == 0
    assert sorted(torch.load(stats_file, weights_only=True)) == sorted(saved)


def test_full_cov_units_merge_at_finalize_to_what_the_command_computes(tmp_path, demo_data, tiny_model,
                                                                      settings_for) -> None:
    """--full-cov: each unit saves its float64 moments with the co-moments before its manifest; finalize merges
    them (no second pass) into the stats file, with the covariance; a resumed unit saves them again, and a unit
    that has none, or none with co-moments, is read from its shard. Equal to `diffprep latent-stats --full-cov`."""
    from diffprep.cli import main
    from diffprep.report.latent_stats import unit_stats_path
    from diffprep.output import Output
    from diffprep.validation.ownership import ownership
    from diffprep.phases.pipeline import run

    out = tmp_path / "out"
    settings = settings_for(out, demo_data, tiny_model, output={"shard_size": 3},
                            finalize={"train_split": 1.0, "full_cov": True})
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    assert result.samples == 12 and result.validation["ok"], result.validation
    state = out / contract.STATE_DIR
    assert sorted(p.name for p in (state / contract.UNIT_STATS_DIR).iterdir()) == [f"{u:06d}.pt" for u in range(4)]
    assert f"{contract.STATE_DIR}/{unit_stats_path(0)}" in ownership(Output(out)).ours
    first = torch.load(state / contract.LATENT_STATS, weights_only=True)
    assert {"cov", "whiten", "unwhiten", "condition"} <= set(first)
    assert result.validation["summary"]["latent_stats_full"]["samples"] == 12
    # The count and the condition number in the validation summary's latent_stats and in its Markdown report.
    line = result.validation["summary"]["latent_stats"]
    assert (line["count"], line["samples"]) == (12 * 4 * 4, 12) == (int(first["count"]), int(first["samples"]))
    assert line["condition"] == pytest.approx(float(first["condition"]), rel=1e-6) and line["condition"] > 1
    markdown = report_of(json.loads((state / contract.VALIDATION_JSON).read_text())).to_markdown()
    assert f"| latent values per channel | {12 * 4 * 4} (12 samples) |" in markdown
    assert f"| latent covariance condition number | {line['condition']:.4g} |" in markdown

    # Unit 1 lost with its moments (redone on resume: saved again); unit 2's moments gone (an earlier diffprep) and
    # unit 3's per channel only (encoded without --full-cov): both read from their shards.
    (out / contract.unit_manifest_path(1)).unlink()
    (state / unit_stats_path(1)).unlink()
    (state / unit_stats_path(2)).unlink()
    unit3 = torch.load(state / unit_stats_path(3), weights_only=True)
    for moments in unit3["fields"].values():
        del moments["comoment"]
    torch.save(unit3, state / unit_stats_path(3))
    settings.output.on_existing = "resume"
    assert run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked")).validation["ok"]
    assert (state / unit_stats_path(1)).is_file() and not (state / unit_stats_path(2)).exists()
    merged = torch.load(state / contract.LATENT_STATS, weights_only=True)

    path = tmp_path / "stats.pt"
    assert main(["latent-stats", str(out), "--full-cov", "--output", str(path)]) == 0
    computed = torch.load(path, weights_only=True)
    latents = [load_tensor(fields[contract.LATENTS]) for fields in shard_samples(out).values()]
    mean, std, cov = direct(latents)
    for stats in (first, merged):
        for name in ("mean", "std", "cov", "whiten", "unwhiten"):
            assert close32(stats[name], computed[name]), name
        assert int(stats["count"]) == int(computed["count"]) and int(stats["samples"]) == 12
        assert close32(stats["cov"], cov) and close32(stats["mean"], mean) and close32(stats["std"], std)


def report_of(validation: dict) -> ValidationReport:
    """A run's validation report (its JSON) as the report object that writes the Markdown."""
    return ValidationReport(validation["out_dir"], validation["ok"], [Check(**c) for c in validation["checks"]],
                            validation["summary"])


def test_an_sd_vae_posterior_counts_by_its_mean_half_and_a_bad_one_is_named() -> None:
    """The edm-zip archive's ``mean_std.npy`` (mean channels, then std channels): a unit's moments are those of
    the mean half alone, read from the stored bytes; bytes that are no posterior raise the sample's error."""
    import io

    import numpy as np

    from diffprep.report.latent_stats import UnitStats, latent_of
    from diffprep.writer.shards import SampleLoadError, npy_bytes

    generator = torch.Generator().manual_seed(1)
    posteriors = [torch.cat([torch.randn(4, 2, 2, generator=generator), torch.rand(4, 2, 2, generator=generator)])
                  for _ in range(3)]
    unit = UnitStats(full_cov=True)
    for posterior in posteriors:
        unit.add({contract.SD_VAE_POSTERIOR: npy_bytes(posterior), contract.META: b"{}"})
    assert sorted(unit.fields) == [contract.SD_VAE_POSTERIOR]
    got = unit.fields[contract.SD_VAE_POSTERIOR].result()
    mean, std, cov = direct([p[:4] for p in posteriors])
    assert close32(got["mean"], mean) and close32(got["std"], std)
    assert close32(got["cov"], cov) and int(got["count"]) == 3 * 4

    with pytest.raises(SampleLoadError, match="'000000_000001' field 'mean_std.npy' is not a readable .npy"):
        latent_of(contract.SD_VAE_POSTERIOR, b"not a numpy file", "000000_000001")
    odd = io.BytesIO()
    np.save(odd, np.zeros((3, 2, 2), np.float32))
    with pytest.raises(SampleLoadError, match=r"holds float32 \[3, 2, 2\], expected a float posterior \[2C"):
        latent_of(contract.SD_VAE_POSTERIOR, odd.getvalue(), "k")
