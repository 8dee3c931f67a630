"""The LTX-2 family on the tiny offline set: ltx-core loads it, and each record is what the LTX-2 trainer stores.

References, each computed here without going through ``Ltx2Encoders``:
- video latents: ltx-core's ``VideoEncoder`` layers run one by one, the
  posterior mean taken, then normalized with the statistics read from the
  checkpoint file (``(mean - mean_of_means) / std_of_means``);
- audio: the log-mel spectrogram with torchaudio and the parameters of
  consumer-formats.md A3, and ``AudioEncoder``'s layers run one by one, then
  normalized over the 128 ``(channel, frequency)`` features;
- text: the Gemma folder run with transformers alone, then the V1 feature
  extractor's formula (masked mean / range x 8 per layer, then the projection
  read from the checkpoint);
- diffusers, where it overlaps: ``AutoencoderKLLTX2Video`` and
  ``AutoencoderKLLTX2Audio`` with the weights converted by diffusers' own
  ``convert_ltx2_*_to_diffusers``, and the front half of ``LTX2TextConnectors``
  (its normalizations, then the checkpoint's projections). All agree with
  ltx-core to float32 rounding on the tiny set.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch

from safetensors import safe_open
from safetensors.torch import load_file

from diffprep.tools.demo import write_av_clip
from diffprep.errors import ConfigError
from diffprep.families import ltx2, ltx2_gemma
from diffprep.families import ltx2_precomputed as precomputed
from diffprep.families.ltx2_tiny import TINY_CHECKPOINT_NAME, TINY_GEMMA_FOLDER, write_tiny_ltx2
from diffprep.media import audio as clip_audio

FPS = 24
FRAMES = 9
SIZE = 64
CAPTIONS = ["a cat in the city", "  a dog walking on the road at night  ", ""]


@pytest.fixture(scope="module")
def tiny(tiny_ltx2) -> Path:
    return tiny_ltx2


@pytest.fixture(scope="module")
def checkpoint(tiny) -> Path:
    return tiny / TINY_CHECKPOINT_NAME


@pytest.fixture(scope="module")
def gemma(tiny) -> Path:
    return tiny / TINY_GEMMA_FOLDER


@pytest.fixture(scope="module")
def encoders(checkpoint, gemma) -> ltx2.Ltx2Encoders:
    """Every component in float32, so the references can be compared closely."""
    return ltx2.Ltx2Encoders.load(checkpoint, gemma, dtype=torch.float32, decoders=True)


@pytest.fixture(scope="module")
def stored(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint))


def _pixels(seed: int = 0, frames: int = FRAMES, size: int = SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, frames, 3, size, size), dtype=torch.uint8, generator=generator)


def write_clip(path: Path, *, audio_layout: str | None) -> np.ndarray | None:
    """An MP4 clip: FRAMES frames of H.264 at FPS and (unless ``audio_layout`` is None) a 1 s AAC track."""
    return write_av_clip(path, width=SIZE, height=SIZE, frames=FRAMES, fps=FPS, audio_layout=audio_layout)


# --------------------------------------------------------------------------- the tiny set


def test_tiny_checkpoint_is_the_single_file_format_ltx_core_loads(checkpoint, stored):
    from ltx_core.loader import SingleGPUModelBuilder
    from ltx_core.model.audio_vae import (
        AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
        AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER,
        VOCODER_COMFY_KEYS_FILTER,
        AudioDecoderConfigurator,
        AudioEncoderConfigurator,
        VocoderConfigurator,
    )
    from ltx_core.model.video_vae import (
        VAE_DECODER_COMFY_KEYS_FILTER,
        VAE_ENCODER_COMFY_KEYS_FILTER,
        VideoDecoderConfigurator,
        VideoEncoderConfigurator,
    )

    with safe_open(str(checkpoint), framework="pt") as handle:
        config = json.loads(handle.metadata()["config"])
    assert set(config) >= {"vae", "audio_vae", "vocoder", "transformer"}
    assert ltx2.read_checkpoint_config(checkpoint) == config
    assert ltx2.video_scale_factors(config) == ltx2.VideoScaleFactors(time=8, space=32)

    # The trainer's model_loader calls, unchanged: configurator + key filter, built on the CPU.
    for configurator, sd_ops, prefix in (
        (VideoEncoderConfigurator, VAE_ENCODER_COMFY_KEYS_FILTER, "vae.encoder."),
        (VideoDecoderConfigurator, VAE_DECODER_COMFY_KEYS_FILTER, "vae.decoder."),
        (AudioEncoderConfigurator, AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER, "audio_vae.encoder."),
        (AudioDecoderConfigurator, AUDIO_VAE_DECODER_COMFY_KEYS_FILTER, "audio_vae.decoder."),
        (VocoderConfigurator, VOCODER_COMFY_KEYS_FILTER, "vocoder."),
    ):
        module = SingleGPUModelBuilder(
            model_path=str(checkpoint), model_class_configurator=configurator, model_sd_ops=sd_ops
        ).build(device=torch.device("cpu"), dtype=torch.float32)
        state = module.state_dict()
        assert not [name for name, value in state.items() if value.is_meta], configurator.__name__
        for name, value in state.items():
            source = prefix.split(".")[0] + "." + name if name.startswith("per_channel_statistics.") else prefix + name
            assert torch.equal(value, stored[source]), name
    # Statistics are not identity: normalized and raw latents differ.
    assert not torch.allclose(stored["vae.per_channel_statistics.std-of-means"], torch.ones(128))


def test_tiny_gemma_folder_has_the_released_tensor_names(gemma):
    from ltx_core.text_encoders.gemma import GEMMA_LLM_KEY_OPS
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in gemma.iterdir()
    }
    config = Gemma3Config.from_pretrained(gemma)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    expected = set(model.state_dict()) - {"lm_head.weight"}
    with safe_open(str(gemma / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    released = ("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector.")
    assert all(name.startswith(released) for name in names)
    # ltx-core's own key map turns every stored name into a GemmaTextEncoder parameter ("model." + the HF name),
    # except that transformers 5's SiglipVisionModel has no ".vision_model" level any more (another reason
    # load_gemma uses from_pretrained, which converts the released names itself).
    mapped = {GEMMA_LLM_KEY_OPS.apply_to_key(name) for name in names}
    assert None not in mapped
    mapped = {name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.") for name in mapped}
    assert mapped == expected


def test_ltx_core_gemma_builder_does_not_run_on_transformers_5():
    """Why load_gemma uses from_pretrained: ltx-core 1.0.0's Gemma module ops predate transformers 5.

    When this fails, ltx-core's own SingleGPUModelBuilder road works again and load_gemma can go back to it.
    """
    from ltx_core.text_encoders.gemma import GEMMA_MODEL_OPS, GemmaTextEncoderConfigurator

    encoder = GemmaTextEncoderConfigurator.from_config({})  # always Gemma 3 12B, on the meta device
    assert encoder.model.config.text_config.hidden_size == 3840
    with pytest.raises(AttributeError, match="vision_model"):
        GEMMA_MODEL_OPS.mutator(encoder)


@pytest.mark.parametrize(
    "transformer_config",
    [
        {},
        {
            "caption_proj_before_connector": True,
            "caption_projection_first_linear": False,
            "caption_proj_input_norm": False,
            "caption_projection_second_linear": False,
            "num_attention_heads": 32,
            "attention_head_dim": 128,
            "audio_num_attention_heads": 32,
            "audio_attention_head_dim": 64,
        },
    ],
    ids=["v1-ltx2", "v2-ltx2.3"],
)
def test_feature_extractor_for_gemma_12b_is_ltx_cores(transformer_config):
    from ltx_core.text_encoders.gemma import EmbeddingsProcessorConfigurator
    from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX

    text = GEMMA3_CONFIG_FOR_LTX.text_config
    with torch.device("meta"):
        theirs = EmbeddingsProcessorConfigurator.from_config({"transformer": transformer_config}).feature_extractor
        ours = ltx2_gemma.build_feature_extractor(transformer_config, text.hidden_size, text.num_hidden_layers)
    assert type(ours) is type(theirs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_missing_components_are_named(tmp_path, checkpoint, stored):
    from safetensors.torch import save_file

    partial = tmp_path / "video-only.safetensors"
    with safe_open(str(checkpoint), framework="pt") as handle:
        metadata = handle.metadata()
    save_file({k: v for k, v in stored.items() if k.startswith("vae.")}, str(partial), metadata=metadata)
    ltx2.Ltx2Encoders.load(partial, audio=False, text=False)  # video alone loads
    with pytest.raises(ConfigError, match="audio VAE encoder"):
        ltx2.Ltx2Encoders.load(partial, video=False, text=False)
    with pytest.raises(ConfigError, match="no 'config' entry"):
        save_file({"x": torch.zeros(1)}, str(tmp_path / "bare.safetensors"))
        ltx2.read_checkpoint_config(tmp_path / "bare.safetensors")


# --------------------------------------------------------------------------- video


def test_video_latents_are_the_normalized_posterior_mean(encoders, stored):
    from ltx_core.model.video_vae.ops import patchify

    pixels = _pixels()
    latents = encoders.encode_video(pixels)
    assert latents.shape == (1, 128, 1 + (FRAMES - 1) // 8, SIZE // 32, SIZE // 32)

    encoder = encoders.video_encoder
    with torch.no_grad():
        x = (pixels.permute(0, 2, 1, 3, 4).float() / 255.0 - 0.5) / 0.5
        h = encoder.conv_in(patchify(x, patch_size_hw=4, patch_size_t=1))
        for block in encoder.down_blocks:
            h = block(h)
        h = encoder.conv_out(encoder.conv_act(encoder.conv_norm_out(h)))
    mean = h[:, :128]  # uniform log-variance: 128 means, then one shared log-variance channel
    assert h.shape[1] == 129
    stats_mean = stored["vae.per_channel_statistics.mean-of-means"].view(1, -1, 1, 1, 1)
    stats_std = stored["vae.per_channel_statistics.std-of-means"].view(1, -1, 1, 1, 1)
    expected = (mean - stats_mean) / stats_std
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(latents, mean, atol=1e-2)


def test_video_record_is_what_the_trainer_reads(checkpoint, tmp_path):
    bf16 = ltx2.Ltx2Encoders.load(checkpoint, audio=False, text=False)  # the trainer's precision
    latents = bf16.encode_video(_pixels())
    record = precomputed.video_latents_record(latents[0], fps=FPS)
    assert tuple(record) == precomputed.VIDEO_LATENTS_KEYS
    assert record["latents"].dtype == torch.bfloat16 and record["latents"].shape == (128, 2, 2, 2)
    assert (record["num_frames"], record["height"], record["width"], record["fps"]) == (2, 2, 2, 24.0)
    assert all(type(record[k]) is int for k in ("num_frames", "height", "width")) and type(record["fps"]) is float
    path = tmp_path / "x.pt"
    torch.save(record, path)
    loaded = torch.load(path, map_location="cpu", weights_only=True)  # how PrecomputedDataset loads it
    assert torch.equal(loaded["latents"], record["latents"]) and path.stat().st_size < 20_000


def test_video_input_is_checked(encoders):
    with pytest.raises(ValueError, match="8k\\+1"):
        encoders.encode_video(_pixels(frames=8))
    with pytest.raises(ValueError, match="multiples of 32"):
        encoders.encode_video(_pixels(size=48))
    with pytest.raises(ValueError, match="uint8"):
        encoders.encode_video(_pixels().float())


def test_decoders_are_built_on_first_use(checkpoint):
    """Encoding processes never ask for the decoders and the vocoder: they are built when first used."""
    loaded = ltx2.Ltx2Encoders.load(checkpoint, dtype=torch.float32, text=False, decoders=True)
    assert loaded.decoders_built() == []
    assert loaded.audio_decoder is not None and loaded.decoders_built() == ["audio_decoder"]
    assert loaded.video_decoder is not None and loaded.vocoder is not None
    assert ltx2.Ltx2Encoders.load(checkpoint, dtype=torch.float32, text=False).video_decoder is None


def test_video_decodes_back_to_frames(encoders):
    latents = encoders.encode_video(_pixels())
    frames = encoders.decode_video(latents[0])
    assert frames.shape == (FRAMES, SIZE, SIZE, 3) and frames.dtype == torch.uint8


def test_diffusers_ltx2_video_vae_gives_the_same_latents(encoders, stored):
    """diffusers' AutoencoderKLLTX2Video, weights converted by diffusers itself: mode() then (z - mean) / std.

    Equal to ltx-core's normalized latents to float32 rounding: on the encoder
    side the two implementations agree. (diffusers has no waveform->mel step and its
    LTX2Pipeline.encode_prompt stores raw stacked Gemma states, so neither replaces
    ltx-core for audio or text; see consumer-formats.md A4.)
    """
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

    vae_tensors = {k: v.clone() for k, v in stored.items() if k.startswith(("vae.encoder.", "vae.per_channel"))}
    converted = convert_ltx2_vae_to_diffusers(vae_tensors)
    vae = AutoencoderKLLTX2Video(  # the decoder (not compared) as small as it goes: its default is 528M parameters
        latent_channels=128, block_out_channels=(128, 128, 128, 128), layers_per_block=(1, 1, 1, 1, 1), patch_size=4,
        decoder_block_out_channels=(8, 8, 8), decoder_layers_per_block=(1, 1, 1, 1),
    )
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    assert not unexpected and not [k for k in missing if not k.startswith("decoder.")]
    vae.eval()

    pixels = _pixels()
    x = (pixels.permute(0, 2, 1, 3, 4).float() / 255.0 - 0.5) / 0.5
    with torch.no_grad():
        mode = vae.encode(x).latent_dist.mode()
    mean = vae.latents_mean.view(1, -1, 1, 1, 1)
    std = vae.latents_std.view(1, -1, 1, 1, 1)
    torch.testing.assert_close((mode - mean) / std, encoders.encode_video(pixels), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- audio


@pytest.mark.parametrize("layout", ["mono", "stereo", "5.1"])
def test_clip_audio_channels_duration_and_latents(encoders, stored, tmp_path, layout):
    import torchaudio

    clip = tmp_path / f"{layout}.mp4"
    written = write_clip(clip, audio_layout=layout)
    duration = FRAMES / FPS
    audio = clip_audio.load_clip_audio(clip, duration=duration)
    assert audio.sample_rate == 44100 and audio.source_channels == written.shape[0]
    assert audio.waveform.shape == (2, int(duration * 44100)) and audio.waveform.dtype == torch.float32
    left, right = audio.waveform
    if layout == "mono":
        assert torch.equal(left, right)
    else:
        assert not torch.allclose(left, right, atol=1e-3)
    # AAC delays and smooths the tone; its level survives (after the encoder's priming samples).
    written_rms = float(np.sqrt(np.mean(written[0] ** 2)))
    if layout != "5.1":
        assert abs(float(left[4096:].pow(2).mean().sqrt()) - written_rms) < 0.2 * written_rms

    latents = encoders.encode_audio(audio)
    assert latents.duration == pytest.approx(duration, abs=1 / 44100)

    # Reference: mel as consumer-formats.md A3 states it, then AudioEncoder's layers, then the normalization.
    resampled = torchaudio.functional.resample(audio.waveform[None], 44100, 16000)
    mel_transform = torchaudio.transforms.MelSpectrogram(
        sample_rate=16000, n_fft=1024, win_length=1024, hop_length=160, f_min=0.0, f_max=8000.0, n_mels=64,
        window_fn=torch.hann_window, center=True, pad_mode="reflect", power=1.0, mel_scale="slaney", norm="slaney",
    )
    mel = torch.log(torch.clamp(mel_transform(resampled), min=1e-5)).permute(0, 1, 3, 2)
    encoder = encoders.audio_encoder
    with torch.no_grad():
        h = encoder._run_downsampling_path(encoder.conv_in(mel))
        h = encoder.mid.block_2(encoder.mid.attn_1(encoder.mid.block_1(h, temb=None)), temb=None)
        h = encoder.conv_out(encoder.non_linearity(encoder.norm_out(h)))
    means = h[:, :8]
    b, c, t, f = means.shape
    flat = means.permute(0, 2, 1, 3).reshape(b, t, c * f)  # b c t f -> b t (c f)
    flat = (flat - stored["audio_vae.per_channel_statistics.mean-of-means"]) / stored[
        "audio_vae.per_channel_statistics.std-of-means"
    ]
    expected = flat.reshape(b, t, c, f).permute(0, 2, 1, 3)[0]
    assert latents.latents.shape == (8, t, 16) and t == pytest.approx(duration * 25, abs=2)
    torch.testing.assert_close(latents.latents, expected, rtol=1e-4, atol=1e-4)

    record = precomputed.audio_latents_record(latents)
    assert tuple(record) == precomputed.AUDIO_LATENTS_KEYS
    assert record["latents"].dtype == torch.float32
    assert (record["num_time_steps"], record["frequency_bins"]) == (t, 16)
    assert record["duration"] == pytest.approx(duration, abs=1 / 44100) and type(record["duration"]) is float


def test_audio_decodes_back_through_the_vocoder_and_the_mel_figure(encoders):
    """Audio latents -> the audio VAE decoder's mel -> ltx-core's vocoder (24 kHz, 240 samples per mel frame);
    the log-mel L1 of diffprep decode is 0 for the same sound and log 2 for the same sound at half its level."""
    from diffprep.encodings.ltx2_sound import Ltx2Sound

    seconds = 0.5
    time = torch.arange(int(seconds * 44100)) / 44100
    tone = torch.stack([0.4 * torch.sin(2 * np.pi * 440 * time), 0.3 * torch.sin(2 * np.pi * 660 * time)])
    track = clip_audio.ClipAudio(tone.float(), 44100, 2)
    latents = encoders.encode_audio(track).latents
    decoded = encoders.decode_audio(latents)
    assert decoded.sample_rate == encoders.vocoder.output_sampling_rate == 24000
    assert decoded.waveform.shape == (2, (4 * latents.shape[1] - 3) * 240) and decoded.waveform.dtype == torch.float32
    assert decoded.waveform.abs().max() <= 1  # the vocoder's tanh

    sound = Ltx2Sound(encoders)
    assert sound.mel_l1(track, track) == 0
    # Noise fills every mel bin above ltx-core's 1e-5 floor; mel is linear in amplitude (power 1).
    noise = 0.4 * (torch.rand(2, 22050, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    full, half = clip_audio.ClipAudio(noise, 44100, 2), clip_audio.ClipAudio(noise / 2, 44100, 2)
    assert sound.mel_l1(full, half) == pytest.approx(np.log(2), abs=1e-3)
    assert sound.mel_l1(decoded, track) > 0.1  # a random-weight vocoder does not reconstruct
    picture = sound.picture(track)
    assert picture.dtype == torch.uint8 and picture.shape == (3, 64, int(seconds * 16000) // 160 + 1)


def test_diffusers_ltx2_audio_vae_gives_the_same_latents(encoders, stored):
    """diffusers' AutoencoderKLLTX2Audio on the same log-mel input: mode(), packed b t (c f), (z - mean) / std.

    Equal to ltx-core's to float32 rounding. diffusers has no waveform->mel step, so
    the mel comes from ltx-core's AudioProcessor (the trainer's) in both.
    """
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers
    from ltx_core.types import Audio

    tensors = {k: v.clone() for k, v in stored.items() if k.startswith(("audio_vae.encoder.", "audio_vae.per_channel"))}
    vae = AutoencoderKLLTX2Audio(
        ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None, mid_block_add_attention=False
    )
    missing, unexpected = vae.load_state_dict(convert_ltx2_audio_vae_to_diffusers(tensors), strict=False)
    assert not unexpected and not [k for k in missing if not k.startswith("decoder.")]
    vae.eval()

    waveform = torch.sin(torch.arange(12000) / 7.0).expand(1, 2, -1).contiguous()
    audio = clip_audio.ClipAudio(waveform=waveform[0], sample_rate=32000, source_channels=2)
    mel = encoders.audio_processor.waveform_to_mel(Audio(waveform=waveform, sampling_rate=32000))
    with torch.no_grad():
        mode = vae.encode(mel).latent_dist.mode()
    b, c, t, f = mode.shape
    packed = mode.permute(0, 2, 1, 3).reshape(b, t, c * f)
    normalized = ((packed - vae.latents_mean) / vae.latents_std).reshape(b, t, c, f).permute(0, 2, 1, 3)
    torch.testing.assert_close(normalized[0], encoders.encode_audio(audio).latents, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- text


def _reference_v1_features(gemma: Path, stored, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers alone, then the V1 extractor's formula (consumer-formats.md A1 conditions/)."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(gemma, model_max_length=1024)
    tokenizer.padding_side = "left"
    tokens = tokenizer(caption.strip(), padding="max_length", max_length=1024, truncation=True, return_tensors="pt")
    model = Gemma3ForConditionalGeneration.from_pretrained(gemma, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model.model(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states
    x = torch.stack(states, dim=-1)[0]  # [T, D, L]
    keep = tokens.attention_mask[0].bool()
    valid = x[keep]
    mean = valid.mean(dim=(0, 1), keepdim=True)
    spread = valid.amax(dim=(0, 1), keepdim=True) - valid.amin(dim=(0, 1), keepdim=True)
    normed = (8 * (x - mean) / (spread + 1e-6)).reshape(x.shape[0], -1)
    normed[~keep] = 0
    features = normed @ stored["text_embedding_projection.aggregate_embed.weight"].T
    return features, tokens.attention_mask[0]


def test_text_conditions_are_the_feature_extractor_output(encoders, gemma, stored, tmp_path):
    conditions = encoders.encode_text(CAPTIONS)
    assert len(conditions) == len(CAPTIONS)
    for caption, result in zip(CAPTIONS, conditions):
        expected, mask = _reference_v1_features(gemma, stored, caption)
        assert torch.equal(result.prompt_attention_mask, mask.to(torch.int64))
        torch.testing.assert_close(result.video_prompt_embeds, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(result.audio_prompt_embeds, result.video_prompt_embeds)  # V1: audio = video
        # Left padding: zeros, then ones; BOS first among the ones.
        ones = int(mask.sum())
        assert mask[-ones:].all() and not mask[:-ones].any()
        assert result.video_prompt_embeds[:-ones].abs().sum() == 0

    record = precomputed.conditions_record(conditions[0])
    assert set(record) == set(precomputed.CONDITIONS_KEYS)
    assert record["video_prompt_embeds"].shape == (1024, 32) and record["video_prompt_embeds"].dtype == torch.bfloat16
    assert record["audio_prompt_embeds"].shape == (1024, 32) and record["audio_prompt_embeds"].dtype == torch.bfloat16
    assert record["prompt_attention_mask"].shape == (1024,) and record["prompt_attention_mask"].dtype == torch.int64
    torch.save(record, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True).keys() == record.keys()


def test_diffusers_connector_front_half_gives_the_same_conditions(encoders, stored):
    """diffusers' LTX2TextConnectors before its connectors (LTX-2.0: per_layer_masked_mean_norm, then text_proj_in)
    equals conditions/ on the same Gemma hidden states; LTX2Pipeline.encode_prompt alone returns the raw states."""
    from diffusers.pipelines.ltx2.connectors import per_layer_masked_mean_norm

    caption = CAPTIONS[1]
    with torch.no_grad():
        states, mask = encoders.text_encoder.encode(caption, padding_side="left")
        normed = per_layer_masked_mean_norm(torch.stack(states, dim=-1), mask.sum(dim=-1), device="cpu")
        expected = normed[0] @ stored["text_embedding_projection.aggregate_embed.weight"].T
    [result] = encoders.encode_text([caption])
    torch.testing.assert_close(result.video_prompt_embeds, expected, rtol=1e-4, atol=1e-4)


def test_v2_checkpoint_has_separate_audio_features(tmp_path):
    root = write_tiny_ltx2(tmp_path / "v2", seed=3, text_projection="v2")
    encoders = ltx2.Ltx2Encoders.load(
        root / TINY_CHECKPOINT_NAME, root / TINY_GEMMA_FOLDER, video=False, audio=False, dtype=torch.float32
    )
    [result] = encoders.encode_text(["a bird flying over the sea"])
    assert type(encoders.feature_extractor).__name__ == "FeatureExtractorV2"
    assert result.video_prompt_embeds.shape == (1024, 32) and result.audio_prompt_embeds.shape == (1024, 16)
    record = precomputed.conditions_record(result)
    assert record["audio_prompt_embeds"].dtype == torch.bfloat16

    # diffusers' LTX-2.3 front half: per_token_rms_norm, mask, sqrt(width / hidden) rescale, per-modality Linears.
    from diffusers.pipelines.ltx2.connectors import per_token_rms_norm

    stored = load_file(str(root / TINY_CHECKPOINT_NAME))
    with torch.no_grad():
        states, mask = encoders.text_encoder.encode("a bird flying over the sea", padding_side="left")
        normed = per_token_rms_norm(torch.stack(states, dim=-1)).flatten(2, 3)
        normed = torch.where(mask.bool()[..., None], normed, torch.zeros_like(normed))[0]
    for kind, result_embeds in (("video", result.video_prompt_embeds), ("audio", result.audio_prompt_embeds)):
        weight = stored[f"text_embedding_projection.{kind}_aggregate_embed.weight"]
        bias = stored[f"text_embedding_projection.{kind}_aggregate_embed.bias"]
        expected = (normed * (weight.shape[0] / 32) ** 0.5) @ weight.T + bias
        torch.testing.assert_close(result_embeds, expected, rtol=1e-4, atol=1e-4)


def test_text_encoder_in_8bit_runs_on_cpu(checkpoint, gemma):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    low = ltx2.Ltx2Encoders.load(checkpoint, gemma, video=False, audio=False, text_encoder_8bit=True)
    full = ltx2.Ltx2Encoders.load(checkpoint, gemma, video=False, audio=False)
    model = low.text_encoder.model
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    assert linears and all(isinstance(m, bnb.nn.Linear8bitLt) for m in linears)
    assert not isinstance(model.lm_head, bnb.nn.Linear8bitLt)
    assert model.get_memory_footprint() < full.text_encoder.model.get_memory_footprint()
    [low_result] = low.encode_text([CAPTIONS[0]])
    [full_result] = full.encode_text([CAPTIONS[0]])
    assert torch.equal(low_result.prompt_attention_mask, full_result.prompt_attention_mask)
    cosine = torch.nn.functional.cosine_similarity(
        low_result.video_prompt_embeds.float().flatten(), full_result.video_prompt_embeds.float().flatten(), dim=0
    )
    assert cosine > 0.98
    assert low.describe()["text"]["load_in_8bit"] and not full.describe()["text"]["load_in_8bit"]


# --------------------------------------------------------------------------- naming, identity, small rules


@pytest.mark.parametrize(
    ("media", "expected"),
    [
        ("clips/a.mp4", "clips/a.pt"),
        ("  b.mov ", "b.pt"),
        ("deep/er/c.video.mkv", "deep/er/c.video.pt"),
        ("./d.mp4", "d.pt"),
        ("/elsewhere/media/e.mp4", "elsewhere/media/e.pt"),
        ("../other/f.mp4", "data/other/f.pt"),
        ("/data/set/g.mp4", "g.pt"),
    ],
)
def test_precomputed_naming(media, expected):
    relative = precomputed.precomputed_relative_path(media, "/data/set")
    assert relative == PurePosixPath(expected)
    assert precomputed.precomputed_path("/out/.precomputed", "audio_latents", relative) == Path(
        "/out/.precomputed/audio_latents", expected
    )


def test_naming_refuses_empty_and_unknown_kinds():
    with pytest.raises(ValueError, match="empty"):
        precomputed.precomputed_relative_path("  ", "/data/set")
    with pytest.raises(ValueError, match="kind must be one of"):
        precomputed.precomputed_path("/out", "latent", PurePosixPath("a.pt"))


def test_lora_trigger_and_identity(encoders):
    assert precomputed.apply_lora_trigger("a cat", " sks ") == "sks a cat"
    assert precomputed.apply_lora_trigger("a cat", None) == "a cat"
    identity = encoders.describe()
    assert json.loads(json.dumps(identity)) == identity
    # The fetch phase gets the same identity without loading weights.
    assert identity == ltx2.describe_ltx2(encoders.checkpoint, encoders.text_encoder_path, dtype=torch.float32)
    assert identity["family"] == "ltx2" and identity["ltx_core"] == "1.0.0"
    assert identity["audio"] == {"sample_rate": 16000, "mel_bins": 64, "hop_length": 160, "n_fft": 1024}
    assert identity["text"]["feature_extractor"] == "FeatureExtractorV1"
