"""An LTX-2 sample's sound decoded back (audio VAE decoder + vocoder), and how far it is from its source.

For ``diffprep decode`` (the mp4's AAC track, an audio-only sample's WAV and log-mel picture) and the
sanity checks of runs with audio (``diffprep.encodings.ltx2``, ``ltx2_audio``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffprep import contract
from diffprep.media.audio import ClipAudio
from diffprep.writer.shards import load_tensor

# The log-mel pictures of diffprep decode: ltx-core's floor (log 1e-5) to a loud mel bin.
_MEL_FLOOR, _MEL_TOP = math.log(1e-5), 2.0


class Ltx2Sound:
    """A stored sample's sound: its audio latents through the checkpoint's audio VAE decoder and vocoder, and the
    log-mel L1 between two waveforms.

    The audio error figure is the mean absolute difference of the two waveforms' natural-log mel spectrograms
    as ltx-core's ``AudioProcessor`` computes them for the encoder (the checkpoint's rate, 64 bins, hop 160,
    both channels), over their common frames: the representation the audio VAE reconstructs. A waveform SNR
    would not do: the vocoder does not keep the source's phase, so a faithful decode can score 0 dB or less.
    0 means identical; log 2 = 0.69 is every mel bin off by a factor of two (6 dB).
    """

    def __init__(self, encoders: Any) -> None:
        self.encoders = encoders

    def decode(self, sample: Any, field: str = contract.AUDIO_LATENTS) -> ClipAudio:
        """The sound of the sample's ``field`` (its audio latents; ``reference_audio_latents.pth``: its reference)."""
        latents = load_tensor(sample.fields[field], key=sample.key, field=field)
        return self.encoders.decode_audio(latents)

    def mel_l1(self, decoded: ClipAudio, source: ClipAudio) -> float:
        a, b = self.encoders.log_mel(decoded), self.encoders.log_mel(source)
        frames = min(a.shape[1], b.shape[1])
        return float((a[:, :frames] - b[:, :frames]).abs().mean())

    def picture(self, audio: ClipAudio) -> torch.Tensor:
        """The waveform's log-mel spectrogram (channels averaged) as uint8 RGB ``[3, mel_bins, frames]``: time to
        the right, low frequencies at the bottom."""
        mel = self.encoders.log_mel(audio).mean(dim=0).T.flip(0)
        gray = ((mel - _MEL_FLOOR) / (_MEL_TOP - _MEL_FLOOR)).clamp(0, 1).mul(255).round().to(torch.uint8)
        return gray.expand(3, -1, -1).contiguous()


def load_sound(checkpoint: Any, device: str = "auto") -> Ltx2Sound:
    """The audio VAE (decoder, and the encoder's mel processor) and the vocoder of a checkpoint, in float32."""
    from diffprep.families.base import resolve_device
    from diffprep.families.ltx2 import Ltx2Encoders

    return Ltx2Sound(Ltx2Encoders.load(checkpoint, device=resolve_device(device), dtype=torch.float32, video=False,
                                       audio=True, text=False, decoders=True))
