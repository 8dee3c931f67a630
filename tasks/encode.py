"""Task: encode one work unit into its shard and manifest (diffprep.encode.encode_unit).

The encoders are loaded once per process and kept for the next units.
"""

from __future__ import annotations

import json
import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import Settings
from diffprep.encode import encode_unit
from diffprep.encoders import FluxEncoders
from diffprep.images import ImageSpec
from diffprep.plan import read_plan
from diffprep.sources import Source, open_source
from tasks.common import retry_transient, run_token, settings_from

_ENCODERS: dict[str, FluxEncoders] = {}
_LOCK = threading.Lock()


def load_encoders(settings: Settings) -> FluxEncoders:
    key = json.dumps(settings.model.model_dump(mode="json"), sort_keys=True)
    with _LOCK:
        if key not in _ENCODERS:
            _ENCODERS.clear()  # one encoder set per process: free the previous one first
            _ENCODERS[key] = FluxEncoders.load(settings.model, token=run_token(settings))
        return _ENCODERS[key]


def open_run_source(settings: Settings) -> Source:
    return open_source(settings.source, token=run_token(settings))


@task(name="encode-unit", task_run_name="encode-unit-{unit:06d}", retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def encode_unit_task(settings: dict, out_dir: str, unit: int) -> dict:
    s = settings_from(settings)
    result = encode_unit(out_dir, read_plan(out_dir), unit, load_encoders(s), open_run_source(s),
                         ImageSpec.from_config(s.image), batch_size=s.model.batch_size,
                         decode_workers=s.image.decode_workers)
    return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
            "seconds": round(result.seconds, 3), "skipped": result.skipped}
