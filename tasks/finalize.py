"""Task: Energon metadata and split assignment over the committed shards (diffprep.energon.finalize)."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.energon import finalize
from tasks.common import output_from, settings_from, small


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize_task(settings: dict, out_dir: str, replace_split: bool = False,
                  encoding: str = contract.ENCODING_PREENCODED) -> dict:
    s = settings_from(settings)
    f = s.finalize
    result = finalize(output_from(s, out_dir), encoding=encoding, train_split=f.train_split, seed=f.shuffle_seed, workers=f.workers,
                      replace_split=replace_split)
    return small(asdict(result))
