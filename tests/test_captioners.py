"""The captioning models (diffprep/captions/): the tiny Qwen2.5-VL against transformers' own processor and
generate, batch invariance, a clip's frames and patches, and the OpenAI-compatible client against a real HTTP
stand-in on 127.0.0.1 (tests/openai_standin.py)."""

from __future__ import annotations

import base64
import io
import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffprep.captions.frames import caption_input
from diffprep.captions.models import CaptionInput, CaptionSettings, load_captioner, video_patches
from diffprep.captions.server import API_KEY_ENV, ServerCaptioner, ServerError
from diffprep.errors import ConfigError, OfflineError, RejectError
from diffprep.media.mp4 import mp4_bytes
from openai_standin import OpenAIStandin, standin_caption

INSTRUCTION = "Describe this video in detail."


def picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def clip(frames: int, seed: int, fps: float = 8.0, size: tuple[int, int] = (64, 48)) -> bytes:
    """A moving random clip: each frame a shifted copy of one noise picture."""
    base = np.random.default_rng(seed).integers(0, 256, (size[1], size[0] * 2, 3), dtype=np.uint8)
    pixels = np.stack([base[:, k * 4: k * 4 + size[0]] for k in range(frames)])
    return mp4_bytes(torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), fps)


@pytest.fixture(scope="module")
def tiny_captioner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL as `diffprep tiny-model DIR --captioner qwen2.5-vl` writes it."""
    from diffprep.cli import main

    path = tmp_path_factory.mktemp("captioner") / "qwen"
    assert main(["tiny-model", str(path), "--captioner", "qwen2.5-vl"]) == 0
    return path


@pytest.fixture(scope="module")
def captioner(tiny_captioner: Path):
    return load_captioner(CaptionSettings(model=str(tiny_captioner), instruction=INSTRUCTION, max_new_tokens=10))


@pytest.fixture(scope="module")
def samples() -> list[CaptionInput]:
    """Images of three sizes and two clips of different lengths, as the flow reads them (frames.caption_input)."""
    return [
        caption_input("img-a", png(picture(64, 48, 1)), fps=2.0, max_frames=256),
        caption_input("clip-a", clip(12, 2), fps=4.0, max_frames=256),
        caption_input("img-b", png(picture(120, 40, 3)), fps=2.0, max_frames=256),
        caption_input("img-c", png(picture(30, 30, 4)), fps=2.0, max_frames=256),
        caption_input("clip-b", clip(6, 5, size=(48, 64)), fps=4.0, max_frames=3),
    ]


# --- the transformers captioner -------------------------------------------------------------------------------------


def test_tiny_captioner_is_the_same_files_for_the_same_seed(tiny_captioner, tmp_path):
    from diffprep.captions.tiny import write_tiny_qwen2_5_vl

    again = write_tiny_qwen2_5_vl(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_captioner.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "preprocessor_config.json", "video_preprocessor_config.json"} <= set(names)
    assert names == sorted(p.name for p in again.iterdir())
    assert all((tiny_captioner / n).read_bytes() == (again / n).read_bytes() for n in names)
    with pytest.raises(ConfigError, match="already holds a model"):
        write_tiny_qwen2_5_vl(again)


def test_image_captions_equal_transformers_own_processor_and_generate(tiny_captioner, captioner, samples,
                                                                      monkeypatch):
    """transformers' Qwen2_5_VLProcessor (its image path) + generate, one sample at a time, give diffprep's captions
    and inputs. The processor class refuses to be built without torchvision only because its class check looks up
    the video processor's (torchvision-only) base class: that check alone is bypassed, nothing of the processing."""
    from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessorPil)
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, argument: None)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(tiny_captioner),
        tokenizer=AutoTokenizer.from_pretrained(tiny_captioner, padding_side="left"), video_processor=None,
        chat_template=(tiny_captioner / "chat_template.jinja").read_text(encoding="utf-8"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_captioner).eval()
    images = [item for item in samples if not item.is_video]
    for item in images:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=item.frames, padding=True, return_tensors="pt")
        ours = captioner.inputs([item])
        assert sorted(ours) == sorted(inputs) and all(torch.equal(ours[k], inputs[k]) for k in inputs)
        out = model.generate(**inputs, do_sample=False, max_new_tokens=10)
        expected = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
        assert captioner.caption([item]) == [expected.strip()]
    # The pixels reach the model: different images, different captions.
    assert len({captioner.caption([item])[0] for item in images}) == len(images)


def test_a_clip_is_a_video_with_its_frame_times(captioner, samples):
    """A clip goes in as pixel_values_videos with its grid and seconds per temporal patch; its patches are laid out
    as transformers' own patchify lays them (two equal frames == the image processor's patches of that frame)."""
    item = samples[1]
    inputs = captioner.inputs([item])
    assert "pixel_values" not in inputs and inputs["video_grid_thw"].tolist()[0][0] == (len(item.frames) + 1) // 2
    assert inputs["second_per_grid_ts"].tolist() == [pytest.approx(2 / item.fps)]
    tokens = int((inputs["input_ids"] == captioner.video_token_id).sum())
    assert tokens == inputs["video_grid_thw"].prod().item() // 4 == int((inputs["mm_token_type_ids"] == 2).sum())

    frame = picture(130, 90, 9)
    video = dict(captioner.video, size=dict(captioner.image_processor.size))
    patches, grid, seconds = video_patches(CaptionInput("still", [frame, frame], fps=2.0), video)
    image = captioner.image_processor(images=[frame], return_tensors="pt")
    assert torch.equal(patches, image["pixel_values"]) and grid.tolist() == image["image_grid_thw"][0].tolist()
    assert seconds == 1.0
    with pytest.raises(ConfigError, match="one frame for an image"):
        captioner.inputs([CaptionInput("two-stills", [frame, frame])])
    # The clip's motion reaches the model: its frames reversed give another caption.
    reversed_clip = CaptionInput("clip-r", item.frames[::-1], fps=item.fps)
    assert captioner.caption([reversed_clip]) != captioner.caption([item])


def test_captions_do_not_depend_on_the_batch(captioner, samples):
    """Greedy: each sample's caption is the same alone, in a mixed batch, reversed, or split otherwise."""
    alone = [captioner.caption([item])[0] for item in samples]
    assert captioner.caption(samples) == alone
    assert captioner.caption(samples[::-1]) == alone[::-1]
    assert captioner.caption(samples[1:3]) + captioner.caption(samples[3:] + samples[:1]) == alone[1:] + alone[:1]
    assert captioner.count_tokens("the") == 1 and captioner.count_tokens("") == 0 and captioner.count_tokens("xqz") == 3


def test_describe_records_the_model_files_and_settings(captioner, tiny_captioner):
    described = captioner.describe()
    assert described["backend"] == "transformers" and described["class"] == "Qwen2_5_VLForConditionalGeneration"
    assert described["model"]["source"] == str(tiny_captioner.resolve())
    assert "config.json" in described["model"]["files_sha256"]
    assert "model.safetensors" in described["model"]["weight_bytes"]
    assert CaptionSettings.from_json(described["settings"]) == captioner.settings
    json.dumps(described)


def test_a_hub_model_missing_offline_names_the_ways_out(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(OfflineError, match=r"hf download Qwen/Qwen2.5-VL-7B-Instruct") as caught:
        load_captioner(CaptionSettings())
    assert "local folder" in str(caught.value)
    with pytest.raises(ConfigError, match="not an existing folder"):
        load_captioner(CaptionSettings(model=str(tmp_path / "no such folder")))


def test_settings_refuse_bad_values_naming_them():
    for bad, match in [({"max_new_tokens": 0}, "max_new_tokens"), ({"fps": 0}, "fps"),
                       ({"instruction": " "}, "instruction"), ({"server_url": "localhost:8000"}, "http://")]:
        with pytest.raises(ConfigError, match=match):
            CaptionSettings(**bad)
    with pytest.raises(ConfigError, match="unknown field.*temperature"):
        CaptionSettings.from_json({"temperature": 1})


# --- frames ---------------------------------------------------------------------------------------------------------


def test_clip_frames_are_sampled_at_fps_and_capped_evenly(tmp_path):
    data = clip(16, 7, fps=8.0)  # 2 s
    sampled = caption_input("c", data, fps=2.0, max_frames=256)
    assert len(sampled.frames) == 4 and sampled.fps == 2.0 and sampled.frames[0].size == (64, 48)
    capped = caption_input("c", data, fps=8.0, max_frames=5)  # 16 frames at 8 fps, 5 kept evenly: rate 8 * 4/15
    assert len(capped.frames) == 5 and capped.fps == pytest.approx(8 * 4 / 15, abs=1e-6)
    path = tmp_path / "c.mp4"
    path.write_bytes(data)
    from_path = caption_input("c", path, fps=2.0, max_frames=256)
    assert [f.tobytes() for f in from_path.frames] == [f.tobytes() for f in sampled.frames]
    image = caption_input("i", png(picture(20, 10, 0)), fps=2.0, max_frames=4)
    assert image.fps is None and len(image.frames) == 1 and image.frames[0].mode == "RGB"


def test_bad_media_is_a_named_reject(monkeypatch):
    good = png(picture(40, 30, 0))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # Pillow refuses a 40x30 picture at open: still an image
    with pytest.raises(RejectError, match="image_too_large"):
        caption_input("bomb", good, fps=2.0, max_frames=8)
    monkeypatch.undo()
    for data, reason in [(b"", "empty_file"), (good[: len(good) // 2], "image_truncated"),
                         (b"not a picture nor a clip" * 10, "video_decode_error"),
                         (clip(8, 1)[:400], "video")]:
        with pytest.raises(RejectError) as caught:
            caption_input("bad", data, fps=2.0, max_frames=8)
        assert caught.value.reason.startswith(reason), (reason, caught.value)


# --- the OpenAI-compatible server -----------------------------------------------------------------------------------


def server_settings(server: OpenAIStandin, **more) -> CaptionSettings:
    return CaptionSettings(model=server.model, server_url=server.url, instruction=INSTRUCTION, max_new_tokens=64,
                           batch_size=3, **more)


def test_the_server_gets_frames_as_data_urls_greedy_with_max_tokens(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-standin")
    items = [CaptionInput("i", [picture(32, 24, 1)]),
             CaptionInput("c", [picture(32, 24, k) for k in range(3)], fps=2.0),
             CaptionInput("j", [picture(32, 24, 2)])]
    with OpenAIStandin(api_key="sk-standin") as server:
        captioner = load_captioner(server_settings(server))
        assert isinstance(captioner, ServerCaptioner)
        assert captioner.describe()["served_models"] == [server.model]
        captions = captioner.caption(items)
        again = captioner.caption(items[::-1])[::-1]
    posts = [r for r in server.requests if r["method"] == "POST"]
    assert len(posts) == 6 and all(r["path"] == "/v1/chat/completions" for r in posts)
    assert all(r["headers"]["Authorization"] == "Bearer sk-standin" for r in server.requests)
    bodies = {r["body"]["messages"][0]["content"][-1]["text"]: r["body"] for r in posts}
    body = next(b for b in bodies.values() if len(b["messages"][0]["content"]) == 4)  # the clip
    assert body["model"] == server.model and body["temperature"] == 0 and body["max_tokens"] == 64
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * 3 + ["text"]
    assert parts[-1]["text"] == f"These are 3 frames of a video, sampled at 2 frames per second.\n{INSTRUCTION}"
    first = Image.open(io.BytesIO(base64.b64decode(parts[0]["image_url"]["url"].split(",", 1)[1])))
    assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,") and first.size == (32, 24)
    assert captions == again and len(set(captions)) == 3
    assert captions[1] == standin_caption(body)


def test_transient_answers_are_retried_then_succeed():
    with OpenAIStandin() as server:
        server.fail_next = [503, 429]
        captioner = ServerCaptioner(server_settings(server), backoff_s=0)
        assert captioner.caption([CaptionInput("i", [picture(16, 16, 1)])])[0].startswith("a caption ")
    assert len(server.requests) == 3


def test_a_server_still_failing_or_refusing_is_a_clear_error():
    item = CaptionInput("i", [picture(16, 16, 1)])
    with OpenAIStandin() as server:
        server.fail_next = [503] * 3
        with pytest.raises(ServerError, match=r"still answered HTTP 503.*after 3 attempts"):
            ServerCaptioner(server_settings(server), retries=2, backoff_s=0).caption([item])
        server.fail_next = [400]
        with pytest.raises(ServerError, match="HTTP 400"):
            ServerCaptioner(server_settings(server), retries=2, backoff_s=0).caption([item])
        assert len(server.requests) == 4  # a 400 is not asked again
        with pytest.raises(ServerError, match=r"does not serve a model named 'other'.*serves: tiny-vlm"):
            ServerCaptioner(CaptionSettings(model="other", server_url=server.url)).describe()
        with pytest.raises(ServerError, match="HTTP 404.*/v1 endpoint"):
            ServerCaptioner(CaptionSettings(model="tiny-vlm", server_url=server.url.removesuffix("/v1")),
                            backoff_s=0).describe()


def test_an_unreachable_server_and_a_refused_key_name_the_fix(monkeypatch):
    with socket.socket() as probe:  # a port that nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = CaptionSettings(model="m", server_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(ServerError, match=r"cannot be reached after 2 attempts.*is running"):
        ServerCaptioner(settings, retries=1, backoff_s=0).describe()
    monkeypatch.setenv(API_KEY_ENV, "sk-wrong-key")
    with OpenAIStandin(api_key="sk-right") as server:
        with pytest.raises(ServerError, match=f"HTTP 401.*Set {API_KEY_ENV}") as caught:
            ServerCaptioner(server_settings(server), backoff_s=0).describe()
    assert "sk-wrong-key" not in str(caught.value) and "sk-right" not in str(caught.value)
