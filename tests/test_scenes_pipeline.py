"""Posed scenes out: the raw scene shards (energon, fastgen), GAE's scene folders and the Wan scene encoding.

Unit tests build ``PreparedScene``s with known cameras; the end-to-end tests render synthetic scenes with markers at
known 3D points (``tests/scene_render.py``), run the pipeline and re-project every marker through the stored K and
c2w onto the decoded stored frames.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch

from diffprep import contract
from diffprep.report.camera_pictures import camera_views, frustum_points
from diffprep.encodings import gae_layout
from diffprep.encodings.scene_checks import camera_problems, check_scene, intrinsics_rows, load_npy
from diffprep.encodings.scenes import SceneWriter, scene_meta
from diffprep.encodings.scenes_wan import check_scene_shape, latent_frames
from diffprep.errors import ConfigError
from diffprep.media.mp4 import mp4_frames
from diffprep.media.scene_frames import PreparedScene
from diffprep.writer.shards import Reject


def _rotation_y(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _prepared(frames: int = 5, width: int = 32, height: int = 24, depth: bool = False,
              caption: str = "a room") -> PreparedScene:
    c2w = np.tile(np.eye(4), (frames, 1, 1))
    for i in range(frames):
        c2w[i, :3, :3] = _rotation_y(0.1 * i)
        c2w[i, :3, 3] = [0.2 * i, 0.0, -1.0]
    K = np.tile(np.array([[30.0, 0, width / 2], [0, 30.0, height / 2], [0, 0, 1]]), (frames, 1, 1))
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pixels = torch.stack([torch.stack([(x * 7 + k * 9) % 256, (y * 9 + k * 5) % 256, (x + y) * 4 % 256])
                          for k in range(frames)]).to(torch.uint8)
    meta = {"scene_id": "train/000/s1", "num_frames": frames, "fps": 15.0, "height": height, "width": width,
            "rgb_resolution": min(height, width), "source": "re10k", "caption": caption, "split": "train",
            "sampling_mode": "uniform", "frames": [{"index": i, "name": str(i + 1), "original_idx": i}
                                                   for i in range(frames)]}
    maps = np.arange(frames * 8 * 8, dtype=np.uint16).reshape(frames, 8, 8) if depth else None
    return PreparedScene(pixels=pixels, c2w=c2w, K=K, depth=maps, meta=meta)


def test_camera_checks_pass_a_rig_and_name_each_broken_camera():
    scene = _prepared()
    assert camera_problems(scene.c2w, scene.K, 32, 24) == []
    broken = scene.c2w.copy()
    broken[1, :3, 1] *= -1  # a flipped axis: det -1
    broken[2, 3] = [0, 0, 1, 1]
    broken[3, 0, 0] = np.nan
    K = scene.K.copy()
    K[4, 0, 0] = -30.0
    K[0, 0, 2] = 100.0  # principal point far outside the 32-wide frame
    problems = camera_problems(broken, K, 32, 24)
    assert [p.split(":")[0] for p in problems] == ["frame 0", "frame 1", "frame 2", "frame 3", "frame 4"]
    assert "principal point" in problems[0] and "det -1" in problems[1] and "last row" in problems[2]
    assert "non-finite" in problems[3] and "fx -30" in problems[4]
    # Both forms of K: [N, 3, 3] and rows fx fy cx cy.
    assert camera_problems(broken, intrinsics_rows(K), 32, 24) == problems


def test_scene_fields_store_the_cameras_row_per_decoded_frame_and_refuse_a_bad_one():
    scene = _prepared(depth=True)
    writer = SceneWriter(crf=18, depth=True, fps=15.0)
    fields = writer.fields(scene, "a room", "train/000/s1")
    assert sorted(fields) == sorted(contract.SCENE_FIELDS + (contract.SCENE_DEPTH,))
    poses = load_npy(fields[contract.SCENE_POSES], key="k", field="poses")
    rows = load_npy(fields[contract.SCENE_INTRINSICS], key="k", field="K")
    assert poses.dtype == np.float32 and poses.shape == (5, 4, 4) and np.allclose(poses, scene.c2w, atol=1e-7)
    assert rows.dtype == np.float32 and rows.tolist() == [[30.0, 30.0, 16.0, 12.0]] * 5
    assert mp4_frames(fields[contract.RAW_VIDEO]).shape == (5, 3, 24, 32)
    assert load_npy(fields[contract.SCENE_DEPTH], key="k", field="d").dtype == np.uint16
    assert check_scene("k", fields[contract.RAW_VIDEO], poses, rows, fields[contract.RAW_VIDEO_META],
                       load_npy(fields[contract.SCENE_DEPTH], key="k", field="d"),
                       {"frames": 5, "size": None, "depth": True}) == []
    assert check_scene("k", fields[contract.RAW_VIDEO], poses[:4], rows, fields[contract.RAW_VIDEO_META], None,
                       {"frames": 6, "depth": True}) == [
        "k: 4 poses and 5 intrinsics for 5 frames", "k: no depth maps; the plan writes them",
        "k: 5 frames, the plan keeps 6"]
    scene.c2w[2, :3, 0] *= -1
    rejected = writer.fields(scene, "a room", "train/000/s1")
    assert isinstance(rejected, Reject) and rejected.reason == "bad_camera" and "frame 2" in rejected.detail


def test_gae_meta_puts_every_scalar_before_frames_and_reads_as_gaes_index_reads_it(tmp_path):
    caption = 'a "frames" word, and "frames": in the caption'
    scene = _prepared(depth=True, caption=caption)
    fields = SceneWriter(crf=18, depth=True, fps=15.0).fields(scene, caption, "train/000/s1")
    files = gae_layout.scene_files(fields)
    assert sorted(files) == sorted(gae_layout.FILES)
    meta = json.loads(files[contract.GAE_META])
    keys = list(meta)
    assert keys[:7] == ["scene_id", "num_frames", "fps", "height", "width", "rgb_resolution", "source"]
    assert keys[-1] == "frames" and "caption" in keys
    assert list(meta["frames"][0]) == ["index", "name", "original_idx", "c2w", "K"]
    prefix = gae_layout.gae_prefix(files[contract.GAE_META].decode())
    assert prefix == {k: v for k, v in meta.items() if k != "frames"}
    assert prefix["caption"] == caption and prefix["num_frames"] == 5 and prefix["rgb_resolution"] == 24
    # depth.npz: np.load reads depth_mm as uint16, and the same maps give the same bytes (fixed zip dates).
    with np.load(io.BytesIO(files[contract.GAE_DEPTH])) as archive:
        assert archive[contract.GAE_DEPTH_KEY].dtype == np.uint16 and archive[contract.GAE_DEPTH_KEY].shape == (5, 8, 8)
    assert gae_layout.depth_npz(scene.depth) == files[contract.GAE_DEPTH]
    assert zipfile.ZipFile(io.BytesIO(files[contract.GAE_DEPTH])).infolist()[0].date_time == (1980, 1, 1, 0, 0, 0)
    folder = tmp_path / "train" / "s1"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    assert gae_layout.scene_problems(tmp_path, "train/s1", {"frames": 5, "depth": True}) == []
    (folder / contract.GAE_CAPTION).write_text("another")
    assert gae_layout.scene_problems(tmp_path, "train/s1", None) == ["train/s1/caption.txt differs from meta.json's "
                                                                      "caption"]


def test_gae_folders_follow_gaes_packers_and_refuse_unsafe_ids():
    assert gae_layout.folder_of("train/000/abc", "re10k") == "train/abc"
    assert gae_layout.folder_of("train/000/abc/chunk_001", "re10k") == "train/abc/chunk_001"
    assert gae_layout.folder_of("1K/xyz", "dl3dv") == "xyz"
    assert gae_layout.folder_of("site/scan_2/chunk_000", "scannetpp") == "site/scan_2/chunk_000"
    assert gae_layout.folder_of("a%25b", "colmap") == "a%b"
    for bad in ("../x", "a/.diffprep/b", ".hidden"):
        assert gae_layout.folder_of(bad, "colmap") is None


def test_wan_scene_shapes_and_latent_frame_coverage():
    assert latent_frames(9, 4) == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert latent_frames(1, 4) == [[0]]
    check_scene_shape(17, 64, 8, 4)
    with pytest.raises(ConfigError, match=r"--scene-frames 20: Wan encodes 1 \+ 4k frames; use 17 or 21"):
        check_scene_shape(20, 64, 8, 4)
    with pytest.raises(ConfigError, match="--scene-resolution 60: Wan needs a multiple of 8; use 56 or 64"):
        check_scene_shape(17, 60, 8, 4)
    with pytest.raises(ConfigError, match="needs --scene-frames"):
        check_scene_shape(None, 64, 8, 4)


def test_camera_drawing_puts_each_frustum_where_its_camera_looks():
    scene = _prepared(frames=4)
    rows = intrinsics_rows(scene.K)
    points = frustum_points(scene.c2w, rows, 32, 24, depth=1.0)
    # The corners lie in front of the camera along its +z axis (OpenCV), at depth 1.
    forward = scene.c2w[0, :3, 2]
    assert np.allclose((points[0, 1:] - points[0, 0]) @ forward, 1.0)
    picture = camera_views(scene.c2w, rows, 32, 24)
    assert picture.dtype == torch.uint8 and picture.shape == (3, 256, 512)
    assert len(torch.unique(picture.reshape(3, -1), dim=1).T) > 4  # drawn: more than the background and text
    assert scene_meta(scene, "c", "train/000/s1", 15.0)["frames"][3]["c2w"] == scene.c2w[3].tolist()


# --- end to end: rendered scenes through the pipeline, markers re-projected on the stored frames ----------------

import hashlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import diffprep.flows.encode  # noqa: E402,F401  (Prefect's log handler must bind to pytest's session stream)
from diffprep.config import load_settings  # noqa: E402
from diffprep.validation.decode import decode_dataset  # noqa: E402
from diffprep.phases.pipeline import run  # noqa: E402
from scene_render import marker_error, render  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The red, green and blue markers: inside the centre square, their colours survive H.264's 4:2:0 chroma (the white
# marker's colour test also takes the desaturated fringe of its magenta neighbour once decoded).
CHECKED = 3


def _never(*args, **kwargs):
    pytest.fail(f"asked {args}")


def _scene_settings(inp: Path, out: Path, scene_format: str, **extra):
    sections = {
        "source": {"type": "scenes", "input_dir": str(inp), "scene_format": scene_format},
        "output": {"output_dir": str(out), "shard_size": 2, "accept_rejects": 0.0},
        "image": {"decode_workers": 1},
        "scenes": {"frames": 5, "resolution": 48},
        "finalize": {"train_split": 1.0},
    }
    for section, values in extra.items():
        sections[section] = sections.get(section, {}) | values
    return load_settings(overrides=sections)


def _reprojects(c2w, K, frames, rendered) -> float:
    return marker_error(np.asarray(c2w), np.asarray(K), np.asarray(frames), rendered.points[:CHECKED])


def _gae_files(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and contract.STATE_DIR not in p.relative_to(out).parts}


@pytest.fixture(scope="module")
def re10k_scenes(tmp_path_factory) -> tuple[Path, list]:
    """RE10K in both of its forms: GAE's transforms.json (OpenCV c2w, K for a larger w h) and the release's txt
    (world-to-camera, normalized intrinsics); 8 frames each."""
    inp = tmp_path_factory.mktemp("re10k") / "in"
    scenes = [render(inp, "re10k", scene="s0", frames=8, caption="a hall"),
              render(inp, "re10k", scene="s1", frames=8, caption="a kitchen"),
              render(inp, "re10k-txt", scene="clip0", frames=8, caption="a stair")]
    return inp, scenes


def test_gae_layout_end_to_end_chunks_and_reprojection(prefect_server, re10k_scenes, tmp_path):
    inp, scenes = re10k_scenes
    out = tmp_path / "re10k_packed"
    # Every frame kept, chunks of 4: each 8-frame scene is two chunk folders of its own.
    settings = _scene_settings(inp, out, "re10k", output={"layout": "gae"},
                               scenes={"frames": None, "chunk_frames": 4})
    result = run(settings, "raw", ask=_never)
    assert (result.samples, result.rejected, result.validation["ok"]) == (6, 0, True)
    # The sanity check wrote one scene into the state folder, as the layout stores it.
    assert sorted(p.name for p in (out / contract.STATE_DIR / contract.SANITY_DIR / "scene").iterdir()) == sorted(
        gae_layout.FILES[:3])
    folders = sorted(p.parent.relative_to(out).as_posix() for p in out.rglob(contract.GAE_META)
                     if contract.STATE_DIR not in p.parts)
    assert folders == ["test/clip0/chunk_000", "test/clip0/chunk_001", "train/s0/chunk_000", "train/s0/chunk_001",
                       "train/s1/chunk_000", "train/s1/chunk_001"]
    for rendered in scenes:
        name = rendered.source_id.split("/")[-1]
        split = rendered.source_id.split("/")[0]
        for chunk in ("chunk_000", "chunk_001"):
            folder = out / split / name / chunk
            text = (folder / contract.GAE_META).read_text()
            prefix = gae_layout.gae_prefix(text)
            assert prefix["num_frames"] == 4 and prefix["rgb_resolution"] == 48 and prefix["chunk_index"] in (0, 1)
            assert (folder / contract.GAE_CAPTION).read_text() == prefix["caption"] != ""
            meta = json.loads(text)
            frames = mp4_frames((folder / contract.GAE_VIDEO).read_bytes())
            assert frames.shape == (4, 3, 48, 48)
            error = _reprojects([f["c2w"] for f in meta["frames"]], [f["K"] for f in meta["frames"]], frames,
                                rendered)
            assert error < 1.0, (rendered.source_id, chunk, error)
    # A flipped axis, a w2c taken for the c2w or a K left unscaled would not re-project (the check can fail).
    meta = json.loads((out / "train/s0/chunk_000" / contract.GAE_META).read_text())
    frames = mp4_frames((out / "train/s0/chunk_000" / contract.GAE_VIDEO).read_bytes())
    c2w, K = np.array([f["c2w"] for f in meta["frames"]]), np.array([f["K"] for f in meta["frames"]])
    assert _reprojects(c2w @ np.diag([1, -1, -1, 1]), K, frames, scenes[0]) > 1.0
    assert _reprojects(np.linalg.inv(c2w), K, frames, scenes[0]) > 1.0
    assert _reprojects(c2w, K * np.array([[2], [2], [1]]), frames, scenes[0]) > 1.0
    # decode draws the cameras beside the frames.
    report = decode_dataset(out, 1, to_dir=tmp_path / "decoded")
    assert report.previews[0].psnr_db is not None and report.previews[0].psnr_db > 25
    assert (tmp_path / "decoded" / f"{report.previews[0].key}.cameras.png").is_file()
    # Validation reads every camera: a mirrored rotation in one frame fails it, naming the scene and the frame.
    from diffprep.validation import validate_dataset

    meta["frames"][2]["c2w"] = (c2w[2] @ np.diag([-1.0, 1, 1, 1])).tolist()
    (out / "train/s0/chunk_000" / contract.GAE_META).write_text(json.dumps(meta))
    checked = validate_dataset(out)
    assert not checked.ok and "train/s0/chunk_000 frame 2: not a rotation" in checked.to_markdown()


BUCKET = "diffprep-scenes"  # created by the admin fixture (conftest.py)


def _bucket_objects(admin, prefix: str) -> dict[str, bytes]:
    keys = [o["Key"] for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
            for o in page.get("Contents", ())]
    return {key[len(prefix) + 1:]: admin.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys}


def test_fastgen_layout_to_a_bucket_end_to_end_and_reprojection(prefect_server, admin, proxy, aws_env, capsys,
                                                                tmp_path):
    """DL3DV (nerfstudio's OpenGL axes, K for a 4x larger w h) as FastGen's camera video shards, in a bucket."""
    import tarfile

    from diffprep.cli import main

    inp = tmp_path / "dl3dv"
    scenes = [render(inp, "dl3dv", scene=f"s{i}", frames=6, caption=f"a street {i}") for i in range(3)]
    url = f"s3://{BUCKET}/dl3dv_fastgen"
    assert main(["raw", "--source-type", "scenes", "--scene-format", "dl3dv", "--input-dir", str(inp),
                 "--layout", "fastgen", "--scene-frames", "5", "--scene-resolution", "48", "--shard-size", "2",
                 "--output-dir", url, "--output-s3-endpoint-url", proxy.url, "--decode-workers", "1"]) == 0
    assert "validation: passed" in capsys.readouterr().out
    stored = _bucket_objects(admin, "dl3dv_fastgen")
    assert json.loads(stored[contract.SHARD_COUNTS_JSON]) == {"000000.tar": 2, "000001.tar": 1}
    by_id = {rendered.source_id: rendered for rendered in scenes}
    seen = []
    for shard in ("000000.tar", "000001.tar"):
        with tarfile.open(fileobj=io.BytesIO(stored[shard])) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        for key in sorted({name.split(".", 1)[0] for name in members}):
            assert sorted(n.split(".", 1)[1] for n in members if n.startswith(key + ".")) == sorted(
                contract.SCENE_FIELDS)
            meta = json.loads(members[f"{key}.json"])
            poses = np.load(io.BytesIO(members[f"{key}.poses.npy"]))
            rows = np.load(io.BytesIO(members[f"{key}.intrinsics.npy"]))
            frames = mp4_frames(members[f"{key}.mp4"])
            assert (meta["fps"], meta["width"], meta["height"], meta["num_frames"]) == (15.0, 48, 48, 5)
            assert meta["applied_gl2cv"] is True
            assert poses.dtype == rows.dtype == np.float32 and poses.shape == (5, 4, 4) and rows.shape == (5, 4)
            K = np.zeros((5, 3, 3))
            K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2], K[:, 2, 2] = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], 1
            assert _reprojects(poses, K, frames, by_id[meta["source_id"]]) < 1.0, meta["source_id"]
            seen.append(meta["source_id"])
    assert sorted(seen) == sorted(by_id)


def test_wan_scenes_end_to_end_cameras_match_the_encoded_frames(prefect_server, tiny_wan, tmp_path):
    """MVS-Synth (world-to-camera extrinsics) through the tiny Wan set: latents, umT5, and a camera per source frame
    that re-projects every marker onto the frames the VAE encoded (the tiny VAE cannot reconstruct them)."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from diffprep.validation.decode import read_samples, source_media
    from diffprep.writer.plan import read_plan
    from diffprep.writer.scene_cooker import WanSceneTaskEncoder

    inp = tmp_path / "mvssynth"
    scenes = {r.source_id: r for r in (render(inp, "mvssynth", scene=f"s{i}", frames=6) for i in range(2))}
    out = tmp_path / "out"
    settings = _scene_settings(inp, out, "mvssynth", scenes={"resolution": 32},
                               model={"model_path": str(tiny_wan), "precision": "fp32", "min_psnr": 0,
                                      "batch_size": 2, "t5_max_length": 16})
    result = run(settings, "preencoded", ask=_never)
    assert (result.samples, result.rejected, result.validation["ok"]) == (2, 0, True)
    dataset = get_train_dataset(str(out), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=WanSceneTaskEncoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    loaded = {sample.meta["source_id"]: sample for sample in get_loader(dataset)}
    assert sorted(loaded) == sorted(scenes)
    plan = read_plan(out)
    stored = read_samples(out, 2)
    prepared = source_media(plan, stored)
    for sample in stored:
        scene = loaded[sample.meta["source_id"]]
        assert scene.latents.shape == (16, 2, 4, 4) and scene.c2w.shape == (5, 4, 4) and scene.intrinsics.shape == (
            5, 3, 3)
        assert scene.latent_frames == [[0], [1, 2, 3, 4]] and scene.bucket == "32x32x5"
        frames = prepared[sample.key].pixels
        assert _reprojects(scene.c2w.numpy(), scene.intrinsics.numpy(), frames, scenes[sample.meta["source_id"]]) < 1.0
    # Wan's frame count rule is the plan's, named with the values that work.
    with pytest.raises(ConfigError, match="use 5 or 9"):
        run(_scene_settings(inp, tmp_path / "other", "mvssynth", scenes={"frames": 6, "resolution": 32},
                            model={"model_path": str(tiny_wan)}), "preencoded", ask=_never)


def _raw_args(inp: Path, out: Path) -> list[str]:
    return ["raw", "--source-type", "scenes", "--scene-format", "scannetpp", "--input-dir", str(inp), "--layout",
            "gae", "--scene-frames", "5", "--scene-resolution", "48", "--depth-resolution", "16", "--shard-size", "2",
            "--output-dir", str(out), "--decode-workers", "1"]


def _prefect_env() -> dict[str, str]:
    import os

    from prefect.settings import PREFECT_API_URL

    return os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_gae_scenes_killed_then_rerun_give_the_same_folders_and_an_append_adds_only_new_scenes(prefect_server,
                                                                                                 tmp_path):
    """ScanNet++ (depth) as GAE folders: SIGKILL after a unit's files are written but before its manifest, a re-run
    gives the bytes of an uninterrupted run; a scene added later is a new unit, the others stay as they are."""
    import signal

    from diffprep.cli import main
    from diffprep.run.failpoints import ENV as FAILPOINT_ENV

    inp = tmp_path / "scannetpp"
    scenes = [render(inp, "scannetpp", scene=f"scan{i}", frames=6) for i in range(3)]
    reference = tmp_path / "reference"
    assert main(_raw_args(inp, reference)) == 0
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-m", "diffprep", *_raw_args(inp, out)], capture_output=True,
                            text=True, timeout=300, env=_prefect_env() | {FAILPOINT_ENV: "before-manifest@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert main(_raw_args(inp, out)) == 0
    files = _gae_files(out)
    assert files == _gae_files(reference)
    assert sorted(files) == sorted(f"scan{i}/{name}" for i in range(3) for name in gae_layout.FILES)
    depth = np.load(out / "scan0" / contract.GAE_DEPTH)[contract.GAE_DEPTH_KEY]
    assert depth.dtype == np.uint16 and depth.shape == (5, 16, 16)
    meta = json.loads((out / "scan0" / contract.GAE_META).read_text())
    frames = mp4_frames((out / "scan0" / contract.GAE_VIDEO).read_bytes())
    assert _reprojects([f["c2w"] for f in meta["frames"]], [f["K"] for f in meta["frames"]], frames, scenes[0]) < 1.0
    # An append: one more scene, one more unit; the folders written stay byte for byte.
    render(inp, "scannetpp", scene="scan3", frames=6)
    assert main(_raw_args(inp, out)) == 0
    after = _gae_files(out)
    assert {k: v for k, v in after.items() if not k.startswith("scan3/")} == files
    assert sorted(k for k in after if k.startswith("scan3/")) == [f"scan3/{name}" for name in sorted(gae_layout.FILES)]


@pytest.mark.slow
def test_two_torchrun_ranks_write_the_gae_folders_of_one_process(prefect_server, tmp_path):
    from prefect.settings import PREFECT_API_URL
    from test_ranks import _env, _torchrun

    from diffprep.cli import main

    inp = tmp_path / "scannetpp"
    for i in range(4):  # 2 units of 2: one per rank
        render(inp, "scannetpp", scene=f"scan{i}", frames=6)
    reference = tmp_path / "reference"
    assert main(_raw_args(inp, reference)) == 0
    out = tmp_path / "out"
    done = _torchrun(2, ["-m", "diffprep", *_raw_args(inp, out)], _env(PREFECT_API_URL=PREFECT_API_URL.value()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1: encoded units 000001" in done.stdout and "validation: passed" in done.stdout
    assert _gae_files(out) == _gae_files(reference) and len(_gae_files(out)) == 16
