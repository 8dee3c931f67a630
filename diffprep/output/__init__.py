"""Where an output lives: a local folder or an ``s3://bucket/prefix``, its state store, its locks and uploads.

- ``base.py``: ``Output`` (a local folder; what every output offers);
- ``s3.py``: ``S3Output``, a bucket prefix worked through a staging folder;
- ``upload.py``: ``ObjectUpload``, the multipart upload of shards and state files;
- ``msc.py``: the Multi-Storage Client profile Energon reads a bucket through;
- ``locks.py``: one run at a time (``OutputLock``, ``S3Lock``, one ``LockRecord``);
- ``state.py``: ``StateStore``, the ``.diffprep`` folder read and written through its output;
- ``ref.py``: ``OutputRef``, the serializable reference tasks take, and opening outputs (``as_output``).
"""

from diffprep.output.base import LocalOutput, Output
from diffprep.output.locks import LockRecord, OutputLock, S3Lock
from diffprep.output.ref import OutputRef, as_output, open_output, ref_of
from diffprep.output.s3 import STAGING_ENV, S3Output, staging_root
from diffprep.output.state import StateStore

__all__ = [
    "STAGING_ENV",
    "LocalOutput",
    "LockRecord",
    "Output",
    "OutputLock",
    "OutputRef",
    "S3Lock",
    "S3Output",
    "StateStore",
    "as_output",
    "open_output",
    "ref_of",
    "staging_root",
]
