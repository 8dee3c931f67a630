"""What a pipeline stores per sample: the pre-encoded (Flux) and the raw encoding, by Energon subflavor name."""

from diffprep.encodings.base import Encoding, SampleFields
from diffprep.encodings.preencoded import Preencoded
from diffprep.encodings.raw import Raw
from diffprep.errors import ConfigError

ENCODINGS: dict[str, Encoding] = {encoding.name: encoding for encoding in (Preencoded(), Raw())}


def encoding_of_sample(fields) -> Encoding:
    """The encoding whose samples have these fields (a dataset read without its plan)."""
    for encoding in ENCODINGS.values():
        if encoding.holds(fields):
            return encoding
    raise ConfigError(f"no encoding stores samples with the fields {sorted(fields)}")


def get_encoding(name: str) -> Encoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ConfigError(f"encoding must be one of {list(ENCODINGS)}, got {name!r}") from None


__all__ = ["ENCODINGS", "Encoding", "Preencoded", "Raw", "SampleFields", "encoding_of_sample", "get_encoding"]
