"""LTX-2 through the whole pipeline on the tiny set (ltx-core's own loader), real mp4 clips with AAC audio written
here and a dataset.json beside them: the default Energon layout and the LTX trainer's .precomputed/ layout, the audio
gate, and decoding back to clips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# Prefect's console log handler keeps the stream it finds when prefect is first imported: import it here, at
# collection, so that it holds pytest's session stream rather than the capsys buffer of this module's first CLI test
# (the second one would log into that closed buffer).
import diffprep.flows.encode  # noqa: F401

from diffprep import contract
from diffprep.run.approvals import ApprovalRefused
from diffprep.config import load_settings
from diffprep.tools.demo import write_av_clip
from diffprep.encodings import encoding_for, get_encoding
from diffprep.errors import ConfigError
from diffprep.families import family_of_model
from diffprep.phases.pipeline import run
from diffprep.writer.shards import load_tensor, read_manifests
from flow_runs import shard_samples
from latent_direct import close32

BUCKET = "64x64x9"
FPS = 24


def write_dataset(root: Path, clips: dict[str, dict], *, name: str = "dataset.json", **columns) -> Path:
    """``clips``: relative path -> write_av_clip options (``caption`` too); a JSON list beside them."""
    rows = []
    for index, (relative, options) in enumerate(clips.items()):
        options = dict(options)
        caption = options.pop("caption", f"a cat walking in the city {index}")
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            write_av_clip(path, fps=FPS, seed=index, **options)
        rows.append({"caption": caption, "video": relative, **{k: v[index] for k, v in columns.items()}})
    listing = root / name
    listing.write_text(json.dumps(rows), encoding="utf-8")
    return listing


def settings_for(out: Path, listing: Path, model_path: Path, **sections):
    overrides = {
        "source": {"type": "metadata", "metadata_file": str(listing)},
        "output": {"output_dir": str(out), "shard_size": 2, "on_existing": "resume"},
        "model": {"model_path": str(model_path), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "min_psnr": 0.0},
        "video": {"resolution_buckets": BUCKET},
        "finalize": {"train_split": 1.0},
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return load_settings(overrides=overrides)


def never_ask(question, preset=None, *, release=False):
    pytest.fail(f"asked {question.key}: {question.title}")


def aborting(asked: list):
    """An ``ask`` that answers abort to every question, keeping them in ``asked``."""

    def abort(question, preset=None, *, release=False):
        asked.append(question)
        return question.check("abort")

    return abort


def rejects_question(settings):
    """Run ``settings`` answering abort: the one question asked must be the rejects' (encoding done, not finalized)."""
    asked = []
    with pytest.raises(ApprovalRefused, match="aborted"):
        run(settings, "preencoded", ask=aborting(asked))
    [question] = asked
    assert question.key == "rejected-samples"
    return question


def test_family_detection_reads_the_checkpoint_not_its_name(tiny_ltx2, tmp_path):
    assert family_of_model(str(tiny_ltx2)).name == "ltx2"
    renamed = tmp_path / "FLUX.1-dev.safetensors"  # a name says nothing: the metadata config does
    renamed.symlink_to(next(tiny_ltx2.glob("*.safetensors")))
    assert family_of_model(str(renamed)).name == "ltx2"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "ltx-2-19b-dev.safetensors"))
    assert family_of_model(str(tmp_path / "ltx-2-19b-dev.safetensors")).name != "ltx2"
    settings = settings_for(tmp_path / "out", tmp_path / "d.json", tiny_ltx2)
    assert encoding_for(settings, "preencoded") == "ltx2"


def test_t2v_with_audio_end_to_end_in_energon_shards(tiny_ltx2, tmp_path):
    data = tmp_path / "data"
    listing = write_dataset(data, {"clips/a.mp4": {"audio_layout": "stereo"}, "clips/b.mp4": {"audio_layout": "mono"},
                                   "c.mp4": {"audio_layout": "5.1", "caption": "a dog"}})
    out = tmp_path / "out"
    settings = settings_for(out, listing, tiny_ltx2, model={"lora_trigger": "sks"})
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 3 and result.rejected == 0 and result.validation["ok"]
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["encoding"] == "ltx2" and "layout" not in plan["settings"]  # energon: the default, recorded nowhere
    assert plan["expected"]["buckets"] == {BUCKET: [128, 2, 2, 2]}

    stored = shard_samples(out)
    assert len(stored) == 3
    fields = sorted([contract.LATENTS, contract.AUDIO_LATENTS, contract.PROMPT_EMBEDS,
                     contract.PROMPT_ATTENTION_MASK, contract.CAPTION, contract.META])
    for key, sample in stored.items():
        assert sorted(sample) == fields
        latents = load_tensor(sample[contract.LATENTS])
        audio = load_tensor(sample[contract.AUDIO_LATENTS])
        embeds = load_tensor(sample[contract.PROMPT_EMBEDS])
        mask = load_tensor(sample[contract.PROMPT_ATTENTION_MASK])
        assert latents.shape == (128, 2, 2, 2) and latents.dtype == torch.bfloat16
        assert audio.shape[0] == 8 and audio.shape[2] == 16 and audio.dtype == torch.float32
        assert abs(audio.shape[1] - 25 * 9 / FPS) <= 2  # T about 25 per second of the 9 frames kept
        assert embeds.shape == (1024, 32) and embeds.dtype == torch.bfloat16
        assert mask.shape == (1024,) and mask.dtype == torch.int64 and mask[-1] == 1 and mask[0] == 0
        caption = sample[contract.CAPTION].decode()
        meta = json.loads(sample[contract.META])
        assert caption.startswith("sks ") and meta["lora_trigger"] == "sks"
        assert meta["fps"] == FPS and meta["audio_duration"] == pytest.approx(9 / FPS, abs=1e-3)
    channels = sorted(json.loads(s[contract.META])["audio"]["source_channels"] for s in stored.values())
    assert channels == [1, 2, 6]

    # Loaded back through Energon with the LTX-2 cooker.
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    dataset = get_train_dataset(out, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=get_encoding("ltx2").task_encoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    loaded = list(get_loader(dataset))
    assert len(loaded) == 3 and all(s.audio_latents is not None and s.reference_latents is None for s in loaded)
    assert all(torch.equal(s.audio_prompt_embeds, s.prompt_embeds) for s in loaded)  # V1: audio is video's copy

    # The sanity check decoded the sound too; decode writes each clip back with its decoded sound as an AAC track,
    # and the audio figure next to the PSNR (a random-weight vocoder: far from the source, but finite).
    sanity = json.loads((out / contract.STATE_DIR / contract.SANITY_DIR / contract.SANITY_REPORT).read_text())
    assert len(sanity["audio_mel_l1"]) == 2 and all(v > 0 for v in sanity["audio_mel_l1"])
    import av

    from diffprep.validation.decode import decode_dataset

    report = decode_dataset(out, 3, to_dir=tmp_path / "decoded", device="cpu")
    assert all(p.audio_mel_l1 is not None and 0 < p.audio_mel_l1 < 20 and p.psnr_db is not None
               for p in report.previews), [(p.audio_mel_l1, p.note) for p in report.previews]
    assert all("audio_mel_l1" in p for p in report.to_json()["samples"])
    for preview in report.previews:
        with av.open(str(tmp_path / "decoded" / f"{preview.key}.mp4")) as clip:
            video, sound = clip.streams.video[0], clip.streams.audio[0]
            assert (video.frames, float(video.average_rate)) == (9, FPS)
            assert (sound.codec_context.name, sound.codec_context.sample_rate, sound.codec_context.channels) == \
                ("aac", 24000, 2)
            seconds = float(sound.duration * sound.time_base)
        assert abs(seconds - 9 / FPS) < 0.1  # the clip's own length (AAC adds a frame of priming)


def test_skip_audio_reads_no_audio_and_stores_none(tiny_ltx2, tmp_path):
    data = tmp_path / "data"
    listing = write_dataset(data, {"silent.mp4": {"audio_layout": None}, "loud.mp4": {"audio_layout": "stereo"}})
    out = tmp_path / "out"
    result = run(settings_for(out, listing, tiny_ltx2, video={"skip_audio": True}), "preencoded", ask=never_ask)
    assert result.samples == 2 and result.rejected == 0
    assert all(contract.AUDIO_LATENTS not in s for s in shard_samples(out).values())
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["settings"]["video"]["audio"] is False and "audio" not in plan["settings"]["encoders"]


def test_an_unnamed_reference_column_and_bad_reference_buckets_are_refused(tiny_ltx2, tmp_path):
    data = tmp_path / "data"
    listing = write_dataset(data, {"a.mp4": {}}, reference_video=["a.mp4"])
    settings = settings_for(tmp_path / "out", listing, tiny_ltx2)
    with pytest.raises(ConfigError, match="--reference-column reference_video"):
        get_encoding("ltx2").plan_settings(settings, None)
    settings = settings_for(tmp_path / "out", listing, tiny_ltx2, source={"reference_key": "reference_video"},
                            video={"reference_downscale_factor": 4})
    with pytest.raises(ConfigError, match="64x64 / 4 is not a multiple of 32"):
        get_encoding("ltx2").plan_settings(settings, None)


# --------------------------------------------------------------------------- --layout ltx


def trainer_samples(root: Path, sources: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """What the LTX-2 trainer's PrecomputedDataset reads (consumer-formats.md A2): the .pt files globbed in the
    primary folder, kept where every other source has the same relative path, loaded with weights_only=True."""
    primary = root / sources[0]
    samples = {}
    for path in sorted(primary.glob("**/*.pt")):
        relative = path.relative_to(primary)
        if all((root / source / relative).is_file() for source in sources[1:]):
            samples[relative.as_posix()] = {
                source: torch.load(root / source / relative, map_location="cpu", weights_only=True)
                for source in sources}
    return samples


def assert_a1(sample: dict[str, dict], *, frames: int, size: int, fps: float, seconds: float, width: int = 32):
    """Every record's keys, shapes and dtypes as consumer-formats.md A1 states them (no latents/: audio only)."""
    video = sample.get("latents")
    if video is not None:
        assert set(video) == {"latents", "num_frames", "height", "width", "fps"}
        assert video["latents"].dtype == torch.bfloat16
        assert tuple(video["latents"].shape) == (128, 1 + (frames - 1) // 8, size // 32, size // 32)
        assert (video["num_frames"], video["height"], video["width"]) == tuple(video["latents"].shape[1:])
        assert all(type(video[k]) is int for k in ("num_frames", "height", "width")) and video["fps"] == fps
    conditions = sample["conditions"]
    assert set(conditions) == {"video_prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}
    assert conditions["video_prompt_embeds"].shape == (1024, width)
    assert conditions["video_prompt_embeds"].dtype == conditions["audio_prompt_embeds"].dtype == torch.bfloat16
    mask = conditions["prompt_attention_mask"]
    assert mask.shape == (1024,) and mask.dtype == torch.int64 and mask[-1] == 1 and mask[0] == 0  # left-padded
    if "audio_latents" in sample:
        audio = sample["audio_latents"]
        assert set(audio) == {"latents", "num_time_steps", "frequency_bins", "duration"}
        assert audio["latents"].dtype == torch.float32 and audio["latents"].shape[0] == 8
        assert (audio["num_time_steps"], audio["frequency_bins"]) == tuple(audio["latents"].shape[1:]) \
            and audio["frequency_bins"] == 16
        assert abs(audio["num_time_steps"] - 25 * seconds) <= 2 and audio["duration"] == pytest.approx(seconds, 1e-3)


def test_ltx_layout_from_the_cli_is_what_the_trainer_reads(prefect_server, tiny_ltx2, tmp_path, capsys):
    """The issue's command, on the tiny set: a dataset.json beside real clips with AAC audio. These folders
    (latents/, conditions/, audio_latents/) are also all that I2V, video extend, A2V and V2A read (README's mode
    table): their conditioning is chosen at training time."""
    from diffprep.cli import main

    data = tmp_path / "dataset"
    listing = write_dataset(data, {"clips/a.mp4": {"audio_layout": "stereo"}, "clips/b.mp4": {"audio_layout": "mono"},
                                   "c.mp4": {"audio_layout": "5.1"}})
    args = ["encode", "--source-type", "metadata", "--metadata-file", str(listing), "--output-dir", str(data),
            "--model-path", str(tiny_ltx2), "--layout", "ltx", "--resolution-buckets", BUCKET, "--precision", "fp32",
            "--device", "cpu", "--batch-size", "2", "--shard-size", "2", "--min-psnr", "0"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "samples written: 3" in printed
    # The summary says what there is: no blank split line, no unknown size.
    assert "no splits: the trainer reads latents/, conditions/, audio_latents/ as they are" in printed
    assert "splits: \n" not in printed and "? bytes" not in printed and "    latents/: 3 files" in printed

    root = data / contract.PRECOMPUTED_DIR
    samples = trainer_samples(root, ("latents", "conditions", "audio_latents"))
    assert sorted(samples) == ["c.pt", "clips/a.pt", "clips/b.pt"]
    for sample in samples.values():
        assert_a1(sample, frames=9, size=64, fps=float(FPS), seconds=9 / FPS)
    assert sorted(p.name for p in root.iterdir()) == [".diffprep", "audio_latents", "conditions", "latents"]
    assert not (data / contract.STATE_DIR).exists() and not (root / contract.NV_META).exists()

    # The audit's figures and a re-run: complete, nothing rewritten.
    audit = json.loads((root / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert (audit["written"], audit["rejected"], audit["problems"]) == (3, 0, [])
    before = {p: p.read_bytes() for p in root.rglob("*.pt")}
    assert main(args) == 0 and "complete" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in root.rglob("*.pt")} == before

    # validate, decode and finalize find the layout by themselves, named by --output-dir or by .precomputed.
    for named in (data, root):
        assert main(["validate", str(named)]) == 0, capsys.readouterr()
        assert "3 samples in latents/" in capsys.readouterr().out
    assert main(["finalize", str(data)]) == 0 and "3 samples in latents/" in capsys.readouterr().out
    assert main(["decode", str(data), "--samples", "2", "--to", str(tmp_path / "decoded")]) == 0
    assert "2 samples of the ltx2 dataset" in capsys.readouterr().out
    assert len(list((tmp_path / "decoded").glob("*.mp4"))) == 2
    assert {p: p.read_bytes() for p in root.rglob("*.pt")} == before

    # Latent statistics of the records: video at the top, audio under its field's name, each from every record.
    assert main(["latent-stats", str(data), "--full-cov", "--output", str(tmp_path / "stats.pt")]) == 0
    stats = torch.load(tmp_path / "stats.pt", weights_only=True)
    for folder, got in (("latents", stats), ("audio_latents", stats["audio_latents"])):
        values = torch.cat([s[folder]["latents"].double().reshape(s[folder]["latents"].shape[0], -1)
                            for s in samples.values()], dim=1)
        assert close32(got["mean"], values.mean(dim=1)) and int(got["samples"]) == 3
        assert close32(got["cov"], torch.cov(values, correction=0))
    # The encode left the same per-channel numbers from its units' moments, in the layout's own state folder.
    saved = torch.load(root / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)
    assert "cov" not in saved and sorted(p.name for p in (root / contract.STATE_DIR / contract.UNIT_STATS_DIR)
                                         .iterdir()) == [f"{u:06d}.pt" for u in sorted(read_manifests(root))]
    for got, want in ((saved, stats), (saved["audio_latents"], stats["audio_latents"])):
        assert close32(got["mean"], want["mean"]) and close32(got["std"], want["std"])
        assert int(got["count"]) == int(want["count"]) and int(got["samples"]) == int(want["samples"])


def test_ltx_layout_safety_audio_gate_and_existing_output(tiny_ltx2, tmp_path):
    data = tmp_path / "dataset"
    clips = {"a.mp4": {}, "b.mp4": {}, "silent.mp4": {"audio_layout": None},
             "broken.mp4": {"broken_audio": True}}
    listing = write_dataset(data, clips)
    settings = settings_for(data, listing, tiny_ltx2, output={"layout": "ltx"})

    # The audio gate: two clips without usable audio of four; the run stops, naming them, and does not finalize.
    question = rejects_question(settings)
    assert "2 of 4 samples" in question.description
    assert "`no_audio_stream`" in question.description and "`audio_decode_error`" in question.description
    assert "silent.mp4" in question.description and "broken.mp4" in question.description
    assert "--skip-audio" in question.description  # the audio advice
    root = data / contract.PRECOMPUTED_DIR
    assert not (root / contract.STATE_DIR / contract.VALIDATION_JSON).exists()

    # Accepted ahead of time, it completes: the two clips with audio, every folder one file each.
    settings.output.accept_rejects = 0.5
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 2 and result.rejects_by_reason == {"audio_decode_error": 1, "no_audio_stream": 1}
    assert result.validation["ok"]
    for kind in ("latents", "conditions", "audio_latents"):
        assert sorted(p.name for p in (root / kind).glob("**/*.pt")) == ["a.pt", "b.pt"]

    # The audit checks every folder holds one file per written sample: a stray file fails it.
    from diffprep.phases.audit import audit
    from diffprep.writer.plan import read_plan

    stray = root / "audio_latents" / "stray.pt"
    torch.save({"latents": torch.zeros(1)}, stray)
    report = audit(root, read_plan(root))
    assert any("audio_latents/ holds 3 .pt files for 2 written samples" in p and "stray.pt" in p
               for p in report.problems)
    stray.unlink()

    # Other settings over it: verify-existing asks (reuse / new directory / abort); new-dir is .precomputed-v2.
    other = settings_for(data, listing, tiny_ltx2, output={"layout": "ltx", "accept_rejects": 0.5, "on_existing": None},
                         video={"skip_audio": True})
    asked = []
    with pytest.raises(ApprovalRefused):
        run(other, "preencoded", ask=aborting(asked))
    assert asked[0].key == "existing-output" and "new-dir" in asked[0].choices
    other.output.on_existing = "new-dir"
    result = run(other, "preencoded", ask=never_ask)
    assert result.out_dir.endswith(".precomputed-v2") and result.samples == 4
    v2 = data / ".precomputed-v2"
    assert sorted(p.name for p in v2.iterdir()) == [".diffprep", "conditions", "latents"]
    assert len(list((root / "audio_latents").glob("*.pt"))) == 2  # the first one untouched

    # A record changed behind diffprep's back: its unit is damaged (re-encoded on resume), and verify-existing's
    # look at one sample of every folder names what differs from the plan.
    from diffprep.encodings.ltx_layout import check_shapes
    from diffprep.phases.existing import inspect_output
    from diffprep.output import Output
    from diffprep.writer.shards import read_manifests

    path = root / "latents" / "a.pt"
    record = torch.load(path, weights_only=True)
    torch.save({**record, "latents": record["latents"].float()}, path)
    assert inspect_output(Output(root), read_plan(root)).damaged_units == [0]
    problem = check_shapes(Output(root), read_plan(root), read_manifests(root))
    assert problem == "latents/a.pt: latents has dtype torch.float32, the trainer reads bfloat16"


def test_ic_lora_references_skip_audio_and_decode_in_the_ltx_layout(tiny_ltx2, tmp_path):
    """V2V IC-LoRA: reference clips at (F, H/2, W/2) in reference_latents/; a row without its reference is named;
    decode writes each clip back as mp4 with its PSNR."""
    data = tmp_path / "dataset"
    refs = data / "refs"
    refs.mkdir(parents=True)
    for name in ("a.mp4", "b.mp4"):
        write_av_clip(refs / name, fps=FPS, audio_layout=None, seed=7)
    listing = write_dataset(data, {"a.mp4": {}, "b.mp4": {}, "c.mp4": {}},
                            reference_video=["refs/a.mp4", "refs/b.mp4", "refs/gone.mp4"])
    settings = settings_for(data, listing, tiny_ltx2, output={"layout": "ltx", "accept_rejects": 0.34},
                            source={"reference_key": "reference_video"},
                            video={"reference_downscale_factor": 2, "skip_audio": True})
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 2 and result.rejects_by_reason == {"reference_not_found": 1}
    root = data / contract.PRECOMPUTED_DIR
    samples = trainer_samples(root, ("latents", "conditions", "reference_latents"))
    assert sorted(samples) == ["a.pt", "b.pt"] and not (root / "audio_latents").exists()
    for sample in samples.values():
        assert_a1(sample, frames=9, size=64, fps=float(FPS), seconds=9 / FPS)
        reference = sample["reference_latents"]
        assert set(reference) == {"latents", "num_frames", "height", "width", "fps"}
        assert reference["latents"].shape == (128, 2, 1, 1) and reference["latents"].dtype == torch.bfloat16

    from diffprep.validation.decode import decode_dataset

    report = decode_dataset(root, 2, to_dir=tmp_path / "decoded", device="cpu")
    assert [p.source_id for p in report.previews] == ["a.mp4", "b.mp4"]
    assert all(p.psnr_db is not None and p.psnr_db > 5 for p in report.previews), [
        (p.psnr_db, p.note) for p in report.previews]
    import av

    with av.open(str(tmp_path / "decoded" / f"{report.previews[0].key}.mp4")) as clip:
        assert clip.streams.video[0].frames == 9


# --------------------------------------------------------------------------- audio only (T2A)


def write_audio_dataset(root: Path, files: dict[str, dict | bytes | None], *, name: str = "dataset.json") -> Path:
    """``files``: relative path -> write_test_tone options (a tone of those seconds, rate, layout, codec and
    container), raw bytes (a file that is not audio), or None (a clip without sound); an ``audio`` column."""
    from diffprep.media.audio import write_test_tone

    rows = []
    for index, (relative, options) in enumerate(files.items()):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(options, bytes):
            path.write_bytes(options)
        elif options is None:
            write_av_clip(path, fps=FPS, audio_layout=None)
        else:
            write_test_tone(path, frequency=220.0 * (index + 1), **options)
        rows.append({"caption": f"a dog barking in the street {index}", "audio": relative})
    listing = root / name
    listing.write_text(json.dumps(rows), encoding="utf-8")
    return listing


WAV = {"codec": "pcm_s16le", "container_format": "wav"}


def test_t2a_end_to_end_in_energon_shards_rejects_and_decode(tiny_ltx2, tmp_path):
    """Audio files of four formats in --audio-durations buckets (the longest one not longer than the file,
    trimmed); too short, not audio and soundless files named; Energon shards read back; decoded to WAV with the
    log-mel L1 against the source."""
    data = tmp_path / "data"
    listing = write_audio_dataset(data, {
        "sounds/a.wav": {"seconds": 2.3, "sample_rate": 22050, "layout": "mono", **WAV},
        "sounds/b.flac": {"seconds": 4.5, "sample_rate": 44100, "codec": "flac", "container_format": "flac"},
        "c.mp3": {"seconds": 4.1, "sample_rate": 44100, "codec": "libmp3lame", "container_format": "mp3"},
        "d.m4a": {"seconds": 2.2, "sample_rate": 48000, "layout": "5.1", "codec": "aac", "container_format": "ipod"},
        "short.wav": {"seconds": 1.4, "sample_rate": 16000, **WAV},
        "broken.m4a": b"not an audio file " * 20,
        "silent.mp4": None,
    })
    out = tmp_path / "out"
    settings = settings_for(out, listing, tiny_ltx2, video={"audio_durations": "2.0;4.0"},
                            model={"lora_trigger": "sks"})
    question = rejects_question(settings)
    assert "3 of 7 samples" in question.description
    assert '--audio-durations "1.4;2;4"' in question.description and "1.400 s" in question.description
    assert "**Audio gate:** 2 files" in question.description
    assert "`broken.m4a`" in question.description and "`silent.mp4`" in question.description

    settings.output.accept_rejects = 0.5
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 4 and result.validation["ok"]
    assert result.rejects_by_reason == {"audio_decode_error": 1, "no_audio_stream": 1, "too_short_audio": 1}
    plan = json.loads((out / contract.STATE_DIR / contract.PLAN_JSON).read_text())
    assert plan["encoding"] == "ltx2_audio" and plan["settings"]["audio"]["durations"] == ["2s", "4s"]
    assert plan["source"]["audio_key"] == "audio" and "video" not in plan["settings"]
    from diffprep.writer.plan import read_plan

    buckets = {sid: unit.bucket for unit in read_plan(out).units for sid in unit.source_ids}
    assert buckets == {"sounds/a.wav": "2s", "d.m4a": "2s", "sounds/b.flac": "4s", "c.mp3": "4s",
                       "short.wav": None, "broken.m4a": None, "silent.mp4": None}
    dataset_yaml = (out / contract.NV_META / "dataset.yaml").read_text()
    assert "encoding: ltx2_audio" in dataset_yaml

    stored = shard_samples(out)
    fields = sorted([contract.AUDIO_LATENTS, contract.PROMPT_EMBEDS, contract.PROMPT_ATTENTION_MASK,
                     contract.CAPTION, contract.META])
    steps = {}
    for sample in stored.values():
        assert sorted(sample) == fields
        meta = json.loads(sample[contract.META])
        audio = load_tensor(sample[contract.AUDIO_LATENTS])
        assert audio.dtype == torch.float32 and audio.shape[0] == 8 and audio.shape[2] == 16
        seconds = {"2s": 2.0, "4s": 4.0}[meta["bucket"]]
        assert meta["audio_duration"] == pytest.approx(seconds, abs=1e-4) and "fps" not in meta
        assert abs(audio.shape[1] - 25 * seconds) <= 2
        steps.setdefault(meta["bucket"], set()).add(audio.shape[1])
        assert load_tensor(sample[contract.PROMPT_EMBEDS]).shape == (1024, 32)
        assert sample[contract.CAPTION].decode().startswith("sks a dog barking")
    assert all(len(v) == 1 for v in steps.values())  # one bucket, one length: the latents stack
    channels = sorted(json.loads(s[contract.META])["audio"]["source_channels"] for s in stored.values())
    assert channels == [1, 2, 2, 6]

    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    dataset = get_train_dataset(out, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=get_encoding("ltx2_audio").task_encoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    loaded = list(get_loader(dataset))
    assert len(loaded) == 4 and all(s.latents is None and s.audio_latents is not None for s in loaded)
    assert sorted(s.bucket for s in loaded) == ["2s", "2s", "4s", "4s"]

    import av

    from diffprep.validation.decode import decode_dataset

    report = decode_dataset(out, 4, to_dir=tmp_path / "decoded", device="cpu")
    assert sorted(p.source_id for p in report.previews) == ["c.mp3", "d.m4a", "sounds/a.wav", "sounds/b.flac"]
    for preview in report.previews:
        assert preview.audio_mel_l1 is not None and 0 < preview.audio_mel_l1 < 20
        assert preview.decoded.shape[:2] == (3, 64) and preview.source.shape == preview.decoded.shape  # log-mel
        with av.open(str(tmp_path / "decoded" / f"{preview.key}.wav")) as wav:
            stream = wav.streams.audio[0]
            assert (stream.codec_context.sample_rate, stream.codec_context.channels) == (24000, 2)
            seconds = float(wav.duration) / av.time_base
        assert abs(seconds - {"2s": 2.0, "4s": 4.0}[buckets[preview.source_id]]) < 0.1


def test_t2a_ltx_layout_from_the_cli_is_what_the_trainer_reads(prefect_server, tiny_ltx2, tmp_path, capsys):
    """--layout ltx with --audio-durations: conditions/ and audio_latents/ only (the trainer's flexible strategy
    for T2A reads those two, conditions/ as its primary folder), named after the audio column's paths."""
    from diffprep.cli import main

    data = tmp_path / "dataset"
    listing = write_audio_dataset(data, {
        "voice/a.wav": {"seconds": 2.1, "sample_rate": 16000, **WAV},
        "b.flac": {"seconds": 2.5, "sample_rate": 44100, "codec": "flac", "container_format": "flac"},
    })
    args = ["encode", "--source-type", "metadata", "--metadata-file", str(listing), "--output-dir", str(data),
            "--model-path", str(tiny_ltx2), "--layout", "ltx", "--audio-durations", "2.0", "--precision", "fp32",
            "--device", "cpu", "--batch-size", "2", "--min-psnr", "0"]
    assert main(args) == 0
    assert "samples written: 2" in capsys.readouterr().out
    root = data / contract.PRECOMPUTED_DIR
    assert sorted(p.name for p in root.iterdir()) == [".diffprep", "audio_latents", "conditions"]
    samples = trainer_samples(root, ("conditions", "audio_latents"))
    assert sorted(samples) == ["b.pt", "voice/a.pt"]
    for sample in samples.values():
        assert "latents" not in sample
        assert_a1(sample, frames=0, size=0, fps=0.0, seconds=2.0)

    from diffprep.validation.decode import decode_dataset

    report = decode_dataset(root, 2, to_dir=tmp_path / "decoded", device="cpu")
    assert all(p.audio_mel_l1 is not None for p in report.previews)
    assert sorted(p.name for p in (tmp_path / "decoded").glob("*.wav")) == [f"{p.key}.wav" for p in report.previews]


def test_t2a_needs_an_audio_file_and_durations(tiny_ltx2, tmp_path):
    """What picks the audio-only mode, and what is refused by name instead of read otherwise."""
    data = tmp_path / "data"
    audio_only = write_audio_dataset(data, {"a.wav": {"seconds": 2.0, **WAV}})
    with pytest.raises(ConfigError, match='needs --audio-durations, e.g. "2.0;4.0"'):
        get_encoding("ltx2").plan_settings(settings_for(tmp_path / "o", audio_only, tiny_ltx2), None)
    clips = write_dataset(data, {"a.mp4": {}}, name="clips.json")
    settings = settings_for(tmp_path / "o", clips, tiny_ltx2, video={"audio_durations": "2.0"})
    assert encoding_for(settings, "preencoded") == "ltx2_audio"
    with pytest.raises(ConfigError, match="--audio-durations is for an audio-only"):
        get_encoding("ltx2_audio").plan_settings(settings, None)
    both = write_dataset(data, {"a.mp4": {}}, name="both.json", audio=["a.wav"])
    # An audio column beside the clips is their sound (test_ltx2_inputs.py); --skip-audio reads none.
    byte, _ = get_encoding("ltx2").plan_settings(settings_for(tmp_path / "o", both, tiny_ltx2), None)
    assert byte["video"]["inputs"] == ["audio"]
    byte, _ = get_encoding("ltx2").plan_settings(settings_for(tmp_path / "o", both, tiny_ltx2,
                                                              video={"skip_audio": True}), None)
    assert "inputs" not in byte["video"]
    masked = write_dataset(data, {"a.mp4": {}}, name="masked.json", audio_mask=["m.wav"])
    with pytest.raises(ConfigError, match="has a 'audio_mask' column, which goes with the clips' audio"):
        get_encoding("ltx2").plan_settings(settings_for(tmp_path / "o", masked, tiny_ltx2,
                                                        video={"skip_audio": True}), None)
    listing = write_audio_dataset(data, {"a.wav": {"seconds": 2.0, **WAV}}, name="a2a.json")
    rows = json.loads(listing.read_text())
    listing.write_text(json.dumps([dict(r, reference_audio="a.wav") for r in rows]))
    byte, expected = get_encoding("ltx2_audio").plan_settings(
        settings_for(tmp_path / "o", listing, tiny_ltx2, video={"audio_durations": "2.0"}), None)
    assert byte["audio"]["inputs"] == ["reference_audio"] and "reference_audio_latents.pth" in expected["fields"]
    listing.write_text(json.dumps([dict(r, video_mask="m.png") for r in rows]))
    with pytest.raises(ConfigError, match="an audio-only run has no frames to mask"):
        get_encoding("ltx2_audio").plan_settings(settings_for(tmp_path / "o", listing, tiny_ltx2,
                                                              video={"audio_durations": "2.0"}), None)
    for video, message in (({"audio_durations": "2.0;x"}, "'x' is not a number"),
                           ({"audio_durations": "0"}, "must be a number of seconds > 0"),
                           ({"audio_durations": "2;2.0"}, "repeats a duration"),
                           ({"audio_durations": "2", "target_fps": 24}, "an audio-only \\(T2A\\) run has none"),
                           ({"audio_durations": "2", "skip_audio": True}, "choose one")):
        settings = settings_for(tmp_path / "o", audio_only, tiny_ltx2, video=video)
        with pytest.raises(ConfigError, match=message):
            get_encoding("ltx2_audio").plan_settings(settings, None)
    with pytest.raises(ConfigError, match="the wan encoding has no audio"):
        get_encoding("wan").variant(settings)
