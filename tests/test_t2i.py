"""GAE's ImageNet T2I shards: packed from class folders, read by a loader written from GAE's rules, verified."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from class_folders import png_bytes, write_class_folders
from PIL import Image

from diffprep import contract
from diffprep.cli import main
from diffprep.errors import ConfigError
from diffprep.validation.ownership import classify
from diffprep.writer.shards import read_manifests
from diffprep.tools.t2i import pack_imagenet
from diffprep.tools.t2i_verify import verify_roots

SPLIT = contract.T2I_SPLIT_FOLDERS["imagenet"]


def gae_loader(roots: list[str], folder: str) -> list[tuple[str, Image.Image, str]]:
    """GAE's rules (src/data/blip3o_wds.py): roots in order, the first with ``<folder>/*.tar`` wins; an ImageNet
    tar counts only with ``<tar>.done``; a sample is its image member (jpg, png, jpeg, webp, in that order) decoded
    by content, and its ``txt`` caption stripped."""
    for root in roots:
        tars = [t for t in sorted((Path(root) / folder).glob("*.tar")) if Path(str(t) + ".done").is_file()]
        if tars:
            break
    else:
        return []
    samples = []
    for tar_path in tars:
        grouped: dict[str, dict[str, bytes]] = {}
        with tarfile.open(tar_path) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                grouped.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for key, fields in grouped.items():
            data = next(fields[e] for e in ("jpg", "png", "jpeg", "webp") if e in fields)
            samples.append((key, Image.open(io.BytesIO(data)).convert("RGB"), fields["txt"].decode().strip()))
    return samples


def test_class_folders_become_shuffled_shards_with_done_markers_that_gae_reads(tmp_path, capsys) -> None:
    # Three classes of exactly one shard's files each: packed in listing order, every shard would hold one class.
    source = write_class_folders(tmp_path / "train", {"n0001": 5, "n0002": 4, "n0003": 4})
    (source / "n0002" / "disguised.JPEG").write_bytes(png_bytes(7))  # ImageNet holds a PNG named .JPEG
    (source / "n0003" / "notes.txt").write_text("no image")
    out = tmp_path / "gae" / "Blip3o_style" / SPLIT
    result = pack_imagenet(str(source), str(out), shard_size=5, seed=3, caption_template="a photo of a {label}")
    assert (result.shards, result.samples) == (3, 14)
    assert [(r.source_id, r.reason) for r in result.rejects] == [("n0003/notes.txt", "unsupported_format")]
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == [f"imagenet_{i:05d}.tar{s}" for i in range(3) for s in ("", ".done")]

    samples = gae_loader([str(tmp_path / "nowhere"), str(tmp_path / "gae" / "Blip3o_style")], SPLIT)
    assert len(samples) == 14
    assert {caption for _, _, caption in samples} == {f"a photo of a n000{i}" for i in (1, 2, 3)}
    assert ("imagenet_n0002_disguised", "a photo of a n0002") in {(k, c) for k, _, c in samples}
    # The original bytes, never re-encoded; a PNG kept under the member the loader takes for it.
    with tarfile.open(next(t for t in out.glob("*.tar") if "imagenet_n0002_disguised.png" in tarfile.open(t)
                           .getnames())) as tar:
        assert tar.extractfile("imagenet_n0002_disguised.png").read() == png_bytes(7)
        first_jpg = next(n for n in tar.getnames() if n.endswith(".jpg"))
        _, wnid, stem = first_jpg.removesuffix(".jpg").split("_", 2)
        assert tar.extractfile(first_jpg).read() == (source / wnid / f"{stem}.JPEG").read_bytes()
    # Shuffled across classes: every shard holds at least two.
    for index in range(3):
        with tarfile.open(out / f"imagenet_{index:05d}.tar") as tar:
            assert len({name.split("_")[1] for name in tar.getnames()}) >= 2, index
    # The same tree packed again (the command, --shard-size 5) gives the same bytes; another seed another order.
    again, other = tmp_path / "again" / SPLIT, tmp_path / "other" / SPLIT
    for folder, seed in ((again, "3"), (other, "4")):
        assert main(["t2i", "imagenet", "--input-dir", str(source), "--output", str(folder), "--shard-size", "5",
                     "--seed", seed, "--caption-template", "a photo of a {label}"]) == 0
    assert "14 samples in 3 shard(s)" in capsys.readouterr().out
    shards = {p.name: p.read_bytes() for p in out.glob("imagenet_*")}
    assert {p.name: p.read_bytes() for p in again.glob("imagenet_*")} == shards
    reshuffled = {p.name: p.read_bytes() for p in other.glob("imagenet_*")}
    assert sorted(reshuffled) == sorted(shards) and reshuffled != shards
    assert sorted(k for k, _, _ in gae_loader([str(other.parent)], SPLIT)) == sorted(k for k, _, _ in samples)
    # diffprep's records name every file it wrote (what an overwrite may remove); nothing is foreign.
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    owned = classify(files, read_manifests(out), None)
    assert not owned.foreign and "imagenet_00002.tar.done" in owned.ours
    assert main(["verify-t2i", str(tmp_path / "gae" / "Blip3o_style")]) == 0


def test_a_resume_rewrites_only_uncommitted_shards_and_an_append_keeps_the_plan(tmp_path) -> None:
    source = write_class_folders(tmp_path / "train", {"a": 3, "b": 3})
    out = tmp_path / SPLIT
    pack_imagenet(str(source), str(out), shard_size=2, seed=1)
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    # A crash after shard 1's tar, before its manifest: shard 1 is not done and is written again, the same bytes.
    (out / contract.unit_manifest_path(1)).unlink()
    (out / "imagenet_00001.tar.done").unlink()
    again = pack_imagenet(str(source), str(out), shard_size=2, seed=1)
    assert again.written == ["imagenet_00001.tar"]
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == before
    # A crash after shard 0's manifest, before its .done: the shard is done, only its marker is written.
    (out / "imagenet_00000.tar.done").unlink()
    repaired = pack_imagenet(str(source), str(out), shard_size=2, seed=1)
    assert repaired.written == [] and (out / "imagenet_00000.tar.done").is_file()
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == before
    # Growing source: old shards stay byte for byte, the new files get new shards.
    write_class_folders(source, {"c": 2})
    grown = pack_imagenet(str(source), str(out), shard_size=2, seed=1)
    assert grown.written == ["imagenet_00003.tar"] and grown.samples == 8
    assert all((out / name).read_bytes() == data for name, data in before.items())
    with pytest.raises(ConfigError, match="seed 1"):
        pack_imagenet(str(source), str(out), shard_size=2, seed=2)


def test_verify_catches_a_missing_done_an_empty_split_and_a_corrupt_shard(tmp_path, capsys) -> None:
    source = write_class_folders(tmp_path / "train", {"a": 2, "b": 2})
    root = tmp_path / "root"
    out = root / SPLIT
    pack_imagenet(str(source), str(out), shard_size=2)
    assert all(r.ok for r in verify_roots([str(root)], ["imagenet"]))

    (out / "imagenet_00001.tar.done").unlink()
    (report,) = verify_roots([str(root)], ["imagenet"])
    assert not report.ok and report.shards == 1 and "imagenet_00001.tar has no" in report.problems[0]

    (root / contract.T2I_SPLIT_FOLDERS["long"]).mkdir()
    assert main(["verify-t2i", str(root)]) == 1
    assert "long       FAILED: 0 shard(s)" in capsys.readouterr().out

    (out / "imagenet_00001.tar.done").write_bytes(b"")
    data = (out / "imagenet_00000.tar").read_bytes()
    (out / "imagenet_00000.tar").write_bytes(data[:1500])  # cut inside the first image
    (report,) = verify_roots([str(root)], ["imagenet"])
    assert not report.ok and any("imagenet_00000.tar" in p for p in report.problems)


def test_an_output_gae_would_never_read_is_refused_and_the_data_dir_said_is_the_one_it_reads(tmp_path, capsys) -> None:
    source = write_class_folders(tmp_path / "train", {"a": 2, "b": 1})
    other = tmp_path / "x" / "other"
    # GAE's loader looks for <data_dir>/ImageNet-1K-T2I only: shards in "other" would never be read.
    assert main(["t2i", "imagenet", "--input-dir", str(source), "--output", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"reads ImageNet shards only from <data_dir>/{SPLIT}/" in err
    assert f"--output {other / SPLIT} (GAE's data_dir {other})" in err and f"--output {tmp_path / 'x' / SPLIT}" in err
    assert not other.exists()  # refused before anything was written
    with pytest.raises(ConfigError, match=SPLIT):
        pack_imagenet(str(source), str(other))
    # Named as the loader looks for it: the data_dir the command names is one the loader finds every sample under.
    assert main(["t2i", "imagenet", "--input-dir", str(source), "--output", str(other / SPLIT)]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.endswith(f"data_dir including {other}")
    assert len(gae_loader([said.rsplit(" ", 1)[-1]], SPLIT)) == 3
