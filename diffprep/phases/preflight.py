"""What can be checked on a run's settings alone, before anything starts or is written.

``diffprep encode`` and ``diffprep raw`` run these before they start a Prefect
server, load an encoder or touch the output (and a flow run does again, first
thing), so an error a user can act on comes in a second and leaves nothing
behind (no server, no flow run recorded as Failed): a missing input folder,
metadata file or tarball, a token file others can read, a device that is not
here, a ``--devices`` spec that does not parse, a ``--num-classes`` that the
source type (or a class-folder tree's top level) contradicts, and every check
the run's encoding makes on its settings (``Encoding.planned``: a layout and
the values it allows, resolution buckets against the VAE's factors, flags
another encoding takes), which needs no source listing; with a hub model it
needs the model's configs, so there only the family-free edm-zip checks run
here and the rest in the plan phase. Checks that need the source's listing (an
impossible split against the planned shards) or a download (a Hugging Face
dataset's classes) are the plan phase's; nothing of a run is written before it
(plan.json is written when the output is prepared, after the plan).
"""

from __future__ import annotations

import os

from diffprep import contract
from diffprep.config import Settings
from diffprep.errors import SourceError
from diffprep.sources.storage import is_s3_url

# The model settings that name folders or files; a run whose set ones are all here resolves its encoding offline.
MODEL_LOCATIONS = ("model_path", "text_encoder_path", "vae_path", "t5_path", "clip_path")
# Source types whose samples never carry a class label (the others: cifar10, imagefolder, huggingface).
UNLABELED_SOURCES = ("directory", "metadata", "webdataset", "scenes")


def preflight(settings: Settings, kind: str | None = None) -> None:
    """Raise the first problem found with ``settings`` that needs neither the source's listing nor a server.

    ``kind``: the command's kind of run (``preencoded``, ``raw``) when known: its encoding's own checks of the
    settings run too (a flow run leaves them to its plan phase, its next step).
    """
    _source_location(settings)
    _num_classes(settings)
    from diffprep.families.hub import resolve_token

    resolve_token(settings.auth.hf_token_file)  # exists, owner-only, one word
    if settings.model.device != "auto":
        from diffprep.families.base import resolve_device

        resolve_device(settings.model.device)  # CUDA here, that device index
    devices = settings.workers.devices
    if devices and devices.strip() != "auto":  # auto asks torch what is here: the run's own business
        from diffprep.run.workers import parse_devices

        parse_devices(devices)
    if kind is not None:
        _encoding(settings, kind)


def _source_location(settings: Settings) -> None:
    source = settings.source
    if source.type in ("directory", "imagefolder", "scenes") and source.input_dir and not is_s3_url(source.input_dir):
        root = os.path.abspath(os.path.expanduser(source.input_dir))
        if not os.path.isdir(root):
            what = "is a file" if os.path.exists(root) else "does not exist"
            holds = {"directory": "with images/ (or videos/) and captions/", "imagefolder": "of class folders",
                     "scenes": "of posed scenes"}[source.type]
            raise SourceError(f"source.input_dir {source.input_dir!r} {what} (resolved to {root}); pass a folder "
                              f"{holds} (--input-dir)")
    if source.type == "metadata" and source.metadata_file and not is_s3_url(source.metadata_file):
        path = os.path.abspath(os.path.expanduser(source.metadata_file))
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            raise SourceError(f"source.metadata_file {source.metadata_file!r} {what} (resolved to {path}); pass "
                              "a JSON, JSONL or CSV file (--metadata-file)")
    if source.type == "cifar10" and source.input_path:
        path = os.path.abspath(os.path.expanduser(source.input_path))
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            raise SourceError(f"source.input_path {source.input_path!r} {what} (resolved to {path}); pass CIFAR-10's "
                              "python release, cifar-10-python.tar.gz (--input-path)")


def _num_classes(settings: Settings) -> None:
    """``--num-classes`` against what the source type says: CIFAR-10 has 10, some sources have no labels, a local
    class-folder tree has its top-level folders (opening it reads that one listing, and checks --class-names
    against it); a Hugging Face column is counted when the plan opens the dataset."""
    source = settings.source
    local_folders = source.type == "imagefolder" and source.input_dir and not is_s3_url(source.input_dir)
    if source.num_classes is None and not local_folders:
        return
    from diffprep.sources.labels import check_num_classes

    if local_folders:
        from diffprep.sources.imagefolder import ImageFolderSource

        folders = ImageFolderSource(source.input_dir, class_names=source.class_names,
                                    caption_template=source.caption_template)
        check_num_classes(source.num_classes, folders.describe())
    elif source.type == "cifar10":
        from diffprep.sources.cifar10 import NUM_CLASSES

        check_num_classes(source.num_classes, {"type": source.type, "classes": NUM_CLASSES})
    elif source.type in UNLABELED_SOURCES:
        check_num_classes(source.num_classes, {"type": source.type})


def _encoding(settings: Settings, kind: str) -> None:
    """The encoding's own checks of the settings (the plan phase runs them again, with the same answer)."""
    if kind == contract.ENCODING_RAW or _model_here(settings):
        from diffprep.encodings import encoding_for, get_encoding

        get_encoding(encoding_for(settings, kind)).planned(settings, None)
    elif settings.output.layout == contract.LAYOUT_EDM_ZIP:  # a hub model: its family is known once fetched
        from diffprep.encodings.edm_zip import check_settings

        check_settings(settings, image_files=False)  # a pre-encoded archive holds latents, not image files


def _model_here(settings: Settings) -> bool:
    """Whether every model location set is a local path (else resolving the encoding asks the hub)."""
    model = settings.model
    paths = [getattr(model, name, None) for name in MODEL_LOCATIONS]
    return all(os.path.exists(os.path.expanduser(path)) for path in paths if path)


__all__ = ["preflight"]
