"""The scene formats read from synthetic scenes written in their real layouts (tests/scene_render.py) and prepared
with a crop + resize: every marker re-projects within a pixel through the stored c2w and K; the named rejects; ids,
chunks, sort order; the reader's scene batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffprep.config import SourceConfig
from diffprep.errors import SourceError
from diffprep.media.scene_frames import SceneSpec
from diffprep.writer.plan import UnitPlan
from diffprep.run.reader import iter_batches
from diffprep.writer.shards import Reject
from diffprep.sources import open_source
from scene_render import FORMATS, marker_error, render

SPEC = SceneSpec(resolution=40)


def source(root: Path, fmt: str, spec: SceneSpec = SPEC, **fields):
    return open_source(SourceConfig(type="scenes", input_dir=str(root), scene_format=fmt, **fields), scenes=spec)


def read_one(src, source_id: str):
    (sample,) = list(src.read([source_id]))
    assert sample.source_id == source_id
    return sample


def rejected(src, source_id: str) -> tuple[str, str]:
    """The reject of ``source_id``, from the source or from preparing it."""
    sample = read_one(src, source_id)
    if sample.reject is not None:
        return sample.reject.reason, sample.reject.detail
    rejects: list[Reject] = []
    batches = list(iter_batches(src, UnitPlan(0, [source_id]), src.spec, 1, rejects))
    assert not batches and len(rejects) == 1, (batches, rejects)
    return rejects[0].reason, rejects[0].detail


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reprojects_after_crop_and_resize(tmp_path, fmt):
    scene = render(tmp_path, fmt, frames=11, caption="a hall")
    src = source(tmp_path, scene.fmt)
    assert list(src.list_ids()) == [scene.source_id]
    sample = read_one(src, scene.source_id)
    assert sample.reject is None, sample.reject
    prepared = SPEC.prepare(sample.scene)
    assert prepared.pixels.shape == (11, 3, 40, 40) and prepared.pixels.dtype.is_floating_point is False
    assert [f["name"] for f in prepared.meta["frames"]] == scene.names  # the format's order (1, 2, ... 10, 11)
    assert marker_error(prepared.c2w, prepared.K, prepared.pixels.numpy(), scene.points) < 1.0
    # The check fails for each mistake a reader can make.
    frames = prepared.pixels.numpy()
    assert marker_error(prepared.c2w @ np.diag([1.0, -1, -1, 1]), prepared.K, frames, scene.points) == np.inf
    assert marker_error(np.linalg.inv(prepared.c2w), prepared.K, frames, scene.points) == np.inf
    assert marker_error(prepared.c2w, prepared.K * [[2, 1, 2], [1, 2, 2], [1, 1, 1]], frames, scene.points) > 1.0
    meta = prepared.meta
    assert (meta["width"], meta["height"], meta["rgb_resolution"], meta["num_frames"]) == (40, 40, 40, 11)
    assert meta["source"] == scene.fmt and meta["scene_id"] == scene.source_id
    assert list(meta)[-1] == "frames"


@pytest.mark.parametrize("fmt", ["re10k", "re10k-txt"])
def test_own_size_keeps_the_cameras(tmp_path, fmt):
    scene = render(tmp_path, fmt, frames=4)
    sample = read_one(source(tmp_path, "re10k"), scene.source_id)
    assert np.allclose(sample.scene.frames[0].K, scene.K) and np.allclose(sample.scene.frames[2].c2w, scene.c2w[2])
    prepared = SceneSpec().prepare(sample.scene)
    assert prepared.pixels.shape == (4, 3, 64, 96)
    assert marker_error(prepared.c2w, prepared.K, prepared.pixels.numpy()) < 0.2


def test_re10k_ids_captions_and_order(tmp_path):
    render(tmp_path, "re10k", scene="b", frames=3, caption="second")
    render(tmp_path, "re10k", scene="a", frames=3)
    render(tmp_path, "re10k-txt", scene="clip1", frames=3, caption="from the txt")
    src = source(tmp_path, "re10k")
    assert list(src.list_ids()) == ["test/clip1", "train/000/a", "train/000/b"]
    captions = {s.source_id: s.caption for s in src.read(list(src.list_ids()))}
    assert captions == {"test/clip1": "from the txt", "train/000/a": "", "train/000/b": "second"}
    # GAE's process/ folder is used when present, and left out of the ids.
    moved = tmp_path / "moved"
    (moved / "process").mkdir(parents=True)
    (tmp_path / "train").rename(moved / "process" / "train")
    (tmp_path / "train_caption.json").rename(moved / "train_caption.json")
    src = source(moved, "re10k")
    assert list(src.list_ids()) == ["train/000/a", "train/000/b"]
    assert read_one(src, "train/000/b").caption == "second"


def test_text_order_when_a_stem_is_not_an_integer(tmp_path):
    scene = render(tmp_path, "re10k", frames=3)
    folder = tmp_path / scene.source_id
    data = json.loads((folder / "transforms.json").read_text())
    for entry in data["frames"]:
        stem = Path(entry["file_path"]).stem
        new = {"1": "b", "2": "a10", "3": "a9"}[stem]
        (folder / f"{stem}.png").rename(folder / f"{new}.png")
        entry["file_path"] = f"images/{new}.png"
    (folder / "transforms.json").write_text(json.dumps(data))
    frames = read_one(source(tmp_path, "re10k"), scene.source_id).scene.frames
    assert [f.name for f in frames] == ["a10", "a9", "b"]


def chunked(spec_frames=None, chunk=4, sampling="uniform"):
    return SceneSpec(frames=spec_frames, chunk_frames=chunk, sampling=sampling, resolution=40)


def test_chunks_are_samples_of_the_kept_frames(tmp_path):
    scene = render(tmp_path, "re10k", frames=11, caption="long")
    render(tmp_path, "re10k", scene="short", frames=5)
    src = source(tmp_path, "re10k", chunked())
    ids = list(src.list_ids())
    # 11 frames in chunks of 4: 0-4, 4-8, then a tail of 3 (>= 2) is a chunk of its own; 5 frames: 4 + a tail of
    # 1 (< 2) merged: one sample.
    assert ids == [f"{scene.source_id}/chunk_000", f"{scene.source_id}/chunk_001", f"{scene.source_id}/chunk_002",
                   "train/000/short"]
    samples = list(src.read(ids))
    assert [s.caption for s in samples] == ["long", "long", "long", ""]
    prepared = [src.spec.prepare(s.scene) for s in samples]
    assert [p.meta["num_frames"] for p in prepared] == [4, 4, 3, 5]
    last = prepared[2].meta
    assert (last["chunk_index"], last["total_chunks"], last["start_frame"], last["end_frame"]) == (2, 3, 8, 11)
    assert [f["global_frame_idx"] for f in last["frames"]] == [8, 9, 10]
    assert [f["name"] for f in last["frames"]] == ["9", "10", "11"]
    assert "chunk_index" not in prepared[3].meta
    for p in prepared[:3]:
        assert marker_error(p.c2w, p.K, p.pixels.numpy()) < 1.0
    # Sampling first, then chunks: 11 frames sampled to 6 (uniform) make chunks 4 + 2.
    src = source(tmp_path, "re10k", chunked(spec_frames=6))
    ids = list(src.list_ids())
    assert ids[:2] == [f"{scene.source_id}/chunk_000", f"{scene.source_id}/chunk_001"]
    second = src.spec.prepare(read_one(src, ids[1]).scene)
    assert [f["original_idx"] for f in second.meta["frames"]] == [8, 10]  # round(i * 10 / 5): 0 2 4 6 8 10
    # A chunk id the scene no longer makes is a reject, not a crash.
    assert rejected(src, f"{scene.source_id}/chunk_007")[0] == "scene_changed"


def test_reader_batches_scenes_of_one_shape(tmp_path):
    for name, frames in (("a", 4), ("b", 4), ("c", 5)):
        render(tmp_path, "re10k", scene=name, frames=frames)
    src = source(tmp_path, "re10k")
    rejects: list[Reject] = []
    unit = UnitPlan(0, list(src.list_ids()))
    batches = list(iter_batches(src, unit, SPEC, 4, rejects))
    assert not rejects
    assert [tuple(b.pixels.shape) for b in batches] == [(2, 4, 3, 40, 40), (1, 5, 3, 40, 40)]
    assert batches[0].source_ids == ["train/000/a", "train/000/b"] and len(batches[0].scenes) == 2
    assert batches[0].scenes[1].c2w.shape == (4, 4, 4) and batches[0].metas[1]["source_id"] == "train/000/b"


def break_scene(tmp_path, how: str) -> tuple[object, str]:
    scene = render(tmp_path, "re10k", frames=4)
    folder = tmp_path / scene.source_id
    data = json.loads((folder / "transforms.json").read_text())
    by_name = {Path(e["file_path"]).stem: e for e in data["frames"]}
    if how == "missing_frame":
        (folder / "3.png").unlink()
    elif how == "missing_pose":
        del by_name["2"]["transform_matrix"]
    elif how == "invalid_pose":
        by_name["2"]["transform_matrix"][0][3] = float("nan")
    elif how == "invalid_rotation":
        by_name["2"]["transform_matrix"][0][0] *= -1  # a flipped axis: det -1
    elif how == "frame_size_mismatch":
        Image.new("RGB", (90, 64)).save(folder / "4.png")
    elif how == "invalid_intrinsics":
        data["fl_x"] = -1.0
    elif how == "scene_unreadable":
        (folder / "transforms.json").write_text("{not json")
        return source(tmp_path, "re10k"), scene.source_id
    elif how == "image_decode_error":
        (folder / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (folder / "transforms.json").write_text(json.dumps(data, allow_nan=True))
    return source(tmp_path, "re10k"), scene.source_id


@pytest.mark.parametrize("how", ["missing_frame", "missing_pose", "invalid_pose", "invalid_rotation",
                                 "frame_size_mismatch", "invalid_intrinsics", "scene_unreadable",
                                 "image_decode_error"])
def test_named_rejects(tmp_path, how):
    src, source_id = break_scene(tmp_path, how)
    assert list(src.list_ids()) == [source_id]
    reason, detail = rejected(src, source_id)
    assert reason == how, detail
    assert detail


def test_too_few_frames_names_the_count_and_the_flag(tmp_path):
    scene = render(tmp_path, "re10k", frames=3)
    reason, detail = rejected(source(tmp_path, "re10k", SceneSpec(frames=5)), scene.source_id)
    assert reason == "too_few_frames" and "3 frames" in detail and "--scene-frames" in detail
    one = render(tmp_path / "one", "re10k", frames=1)
    assert rejected(source(tmp_path / "one", "re10k"), one.source_id)[0] == "too_few_frames"


def test_re10k_txt_distortion_and_missing_frames_folder(tmp_path):
    scene = render(tmp_path, "re10k-txt", frames=3)
    txt = tmp_path / "test" / "scene0.txt"
    lines = txt.read_text().splitlines()
    fields = lines[1].split()
    fields[5] = "0.1"
    txt.write_text("\n".join([lines[0], " ".join(fields), *lines[2:]]) + "\n")
    assert rejected(source(tmp_path, "re10k"), scene.source_id)[0] == "unsupported_camera_model"
    (tmp_path / "test" / "other.txt").write_text(lines[0] + "\n" + "\n".join(lines[2:]) + "\n")
    reason, detail = rejected(source(tmp_path, "re10k"), "test/other")
    assert reason == "missing_frame" and "other/" in detail


def test_stamps_and_missing_scene(tmp_path):
    scene = render(tmp_path, "re10k", frames=3)
    src = source(tmp_path, "re10k")
    before = src.stamps([scene.source_id])[scene.source_id]
    (tmp_path / scene.source_id / "9.png").write_bytes(b"x")
    assert src.stamps([scene.source_id])[scene.source_id] != before
    assert rejected(src, "train/000/gone")[0] == "missing_scene"
    assert rejected(src, "../etc")[0] == "missing_scene"
    described = src.describe()
    assert described["scene_format"] == "re10k" and SceneSpec.from_description(described["scenes"]) == SPEC


def test_open_source_needs_the_format_and_the_spec(tmp_path):
    with pytest.raises(SourceError, match="--scene-format"):
        source(tmp_path, None)
    with pytest.raises(SourceError, match="SceneSpec"):
        open_source(SourceConfig(type="scenes", input_dir=str(tmp_path), scene_format="re10k"))


def test_scannetpp_depth_follows_the_crop(tmp_path):
    scene = render(tmp_path, "scannetpp", frames=4, size=(96, 72))  # depth maps 32x24, a third of the frames
    spec = SceneSpec(resolution=36, depth_resolution=12)
    sample = read_one(source(tmp_path, "scannetpp", spec), scene.source_id)
    prepared = spec.prepare(sample.scene)
    assert prepared.depth.dtype == np.uint16 and prepared.depth.shape == (4, 12, 12)
    # Each stored depth pixel holds the source depth pixel under its centre: the frames' crop (x0 = 12 of 96, a
    # side of 72) is x0 = 4, side 24 in the depth maps' pixels.
    values = prepared.depth.astype(int) - 1
    xs, ys = values % 64, values // 64
    centres = 4 + (np.arange(12) + 0.5) * 2
    assert np.all(np.abs(xs + 0.5 - centres[None, None, :]) <= 0.5)
    assert np.all(np.abs(ys + 0.5 - (np.arange(12) + 0.5)[None, :, None] * 2) <= 0.5)
    meta = prepared.meta
    assert meta["depth_resolution"] == 12 and meta["pose_key"] == "pose" and meta["frames_without_all_inputs"] == 1
    assert [f["original_idx"] for f in meta["frames"]] == [0, 10, 20, 30]
    assert marker_error(prepared.c2w, prepared.K, prepared.pixels.numpy()) < 1.0
    # aligned_pose is the camera in another world: the markers re-project there, not in the first one.
    aligned = spec.prepare(read_one(source(tmp_path, "scannetpp", spec, pose_key="aligned_pose"),
                                    scene.source_id).scene)
    assert marker_error(aligned.c2w, aligned.K, aligned.pixels.numpy(), scene.aligned_points) < 1.0
    assert marker_error(aligned.c2w, aligned.K, aligned.pixels.numpy(), scene.points) > 1.0
    # Without --scene-resolution the depth maps keep their own size.
    assert SceneSpec().prepare(sample.scene).depth.shape == (4, 24, 32)


def test_scannetpp_depth_rejects(tmp_path):
    scene = render(tmp_path, "scannetpp-iphone", frames=3)
    depth = tmp_path / "data" / "scene0" / "iphone" / "depth"
    Image.new("L", (32, 21)).save(depth / "frame_000010.png")  # 8-bit
    reason, detail = rejected(source(tmp_path, "scannetpp"), scene.source_id)
    assert reason == "depth_unreadable" and "16-bit" in detail
    (depth / "frame_000010.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30)
    assert rejected(source(tmp_path, "scannetpp"), scene.source_id)[0] == "depth_unreadable"
    Image.fromarray(np.zeros((40, 32), np.uint16)).save(depth / "frame_000010.png")
    assert rejected(source(tmp_path, "scannetpp"), scene.source_id)[0] == "depth_size_mismatch"


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_distortion_is_refused_by_name_or_recorded(tmp_path):
    ns = render(tmp_path / "ns", "nerfstudio", frames=3)
    edit_json(tmp_path / "ns" / "scene0" / "transforms.json", lambda d: d.update(k1=0.01))
    reason, detail = rejected(source(tmp_path / "ns", "nerfstudio"), ns.source_id)
    assert reason == "unsupported_camera_model" and "k1=0.01" in detail
    edit_json(tmp_path / "ns" / "scene0" / "transforms.json", lambda d: d.update(k1=0, camera_model="OPENCV_FISHEYE"))
    assert "OPENCV_FISHEYE" in rejected(source(tmp_path / "ns", "nerfstudio"), ns.source_id)[1]
    cm = render(tmp_path / "cm", "colmap", frames=3)
    cameras_txt = tmp_path / "cm" / "scene0" / "sparse" / "0" / "cameras.txt"
    cameras_txt.write_text(cameras_txt.read_text().replace("PINHOLE 96 64", "OPENCV 96 64") + "")
    text = cameras_txt.read_text().rstrip("\n") + " 0.01 0 0 0\n"
    cameras_txt.write_text(text)
    reason, detail = rejected(source(tmp_path / "cm", "colmap"), cm.source_id)
    assert reason == "unsupported_camera_model" and "OPENCV" in detail and "image_undistorter" in detail
    # DL3DV: GAE ignores its small distortion; so does diffprep, saying so in meta.json.
    dl = render(tmp_path / "dl", "dl3dv", frames=3, caption="a street")
    edit_json(tmp_path / "dl" / "1K" / "scene0" / "nerfstudio" / "transforms.json", lambda d: d.update(k1=0.02))
    sample = read_one(source(tmp_path / "dl", "dl3dv"), dl.source_id)
    assert sample.caption == "a street" and sample.scene.split == "1K"
    meta = SPEC.prepare(sample.scene).meta
    assert meta["distortion_ignored"] == {"k1": 0.02} and meta["applied_gl2cv"] is True


def test_mvssynth_missing_pose_and_colmap_missing_image(tmp_path):
    mv = render(tmp_path / "mv", "mvssynth", frames=3)
    (tmp_path / "mv" / "scene0" / "poses" / "0001.json").unlink()
    reason, detail = rejected(source(tmp_path / "mv", "mvssynth"), mv.source_id)
    assert reason == "missing_pose" and "0001" in detail
    cm = render(tmp_path / "cm", "colmap", frames=3)
    (tmp_path / "cm" / "scene0" / "images" / "img_001.png").unlink()
    assert rejected(source(tmp_path / "cm", "colmap"), cm.source_id)[0] == "missing_frame"


@pytest.mark.parametrize("fmt", ["re10k", "re10k-txt", "dl3dv", "nerfstudio", "colmap"])
def test_a_listed_frame_without_its_image_is_missing_frame_even_when_sampling_skips_it(tmp_path, fmt):
    # 11 frames, 3 kept (uniform: 0, 5, 10): frame 2's image is never read, yet the camera file lists it. One rule
    # for every format: the scene is the reject missing_frame, never stored with source_frames counting a frame
    # that is not there.
    scene = render(tmp_path, fmt, frames=11)
    spec = SceneSpec(resolution=40, frames=3, sampling="uniform")
    whole = spec.prepare(
        read_one(source(tmp_path, scene.fmt, spec), scene.source_id).scene)
    assert [f["original_idx"] for f in whole.meta["frames"]] == [0, 5, 10] and whole.meta["source_frames"] == 11
    (image,) = [path for path in tmp_path.rglob(f"{scene.names[2]}.png")]
    image.unlink()
    reason, detail = rejected(source(tmp_path, scene.fmt, spec), scene.source_id)
    assert reason == "missing_frame" and scene.names[2] in detail, detail


def test_two_frames_of_one_name_are_a_reject_not_one_kept(tmp_path):
    scene = render(tmp_path, "re10k", frames=3)
    edit_json(tmp_path / scene.source_id / "transforms.json",
              lambda d: d["frames"].append({**d["frames"][0], "file_path": "other/" + d["frames"][0]["file_path"]}))
    reason, detail = rejected(source(tmp_path, "re10k"), scene.source_id)
    assert reason == "scene_unreadable" and "two frames" in detail


def test_settings_need_a_format_and_keep_progressive_to_scenes(tmp_path):
    from diffprep.config import check_runnable, load_settings
    from diffprep.errors import ConfigError

    out = {"output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match="--scene-format re10k|dl3dv"):
        check_runnable(load_settings(overrides={"source": {"type": "scenes", "input_dir": str(tmp_path)},
                                                "output": out}))
    with pytest.raises(ConfigError, match="progressive"):
        check_runnable(load_settings(overrides={"source": {"type": "directory", "input_dir": str(tmp_path)},
                                                "video": {"frame_sampling": "progressive"}, "output": out}))
    settings = load_settings(overrides={"source": {"type": "scenes", "input_dir": str(tmp_path),
                                                   "scene_format": "colmap"},
                                        "video": {"frame_sampling": "progressive"}, "scenes": {"frames": 8},
                                        "output": out})
    check_runnable(settings)
    assert SceneSpec.from_settings(settings) == SceneSpec(frames=8, sampling="progressive")


def test_chunked_listing_with_progressive_sampling_and_a_broken_scene(tmp_path):
    scene = render(tmp_path, "colmap", scene="a", frames=11)
    broken = render(tmp_path, "colmap", scene="b", frames=11)
    (tmp_path / "b" / "sparse" / "0" / "images.txt").write_text("1 not numbers\n\n")
    src = source(tmp_path, "colmap", chunked(spec_frames=10, sampling="progressive"))
    ids = list(src.list_ids())
    # Progressive keeps 10 of 11 (the camera moves a tenth of its extent a frame: each is taken until 10): chunks
    # 4 + 4 + 2; the scene that does not read is listed once, and reading it is its reject.
    assert ids == [f"{scene.source_id}/chunk_{i:03d}" for i in range(3)] + [broken.source_id]
    last = src.spec.prepare(read_one(src, ids[2]).scene)
    assert [f["original_idx"] for f in last.meta["frames"]] == [8, 9]
    assert rejected(src, broken.source_id)[0] == "scene_unreadable"
