"""Resolution buckets: the LTX trainer's WxHxF syntax, refusals that name the fix, and its choice rule."""

from __future__ import annotations

import pytest

from diffprep.errors import ConfigError, RejectError
from diffprep.media.buckets import Bucket, choose_bucket, nearest_frame_counts, parse_buckets


def test_parse_keeps_order_and_ignores_blank_entries():
    buckets = parse_buckets(" 832x480x81; 480x832x81 ;512X512x1;", spatial_factor=16, temporal_factor=4)
    assert buckets == [Bucket(832, 480, 81), Bucket(480, 832, 81), Bucket(512, 512, 1)]
    assert str(buckets[0]) == "832x480x81"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("832x480x80", r"80 frames is not 4k\+1 .*nearest: 77 or 81"),
        ("832x480x0", r"0 frames is not 4k\+1 .*nearest: 1 or 5"),
        ("830x480x81", r"width 830 is not a multiple of 16 .*nearest: 816 or 832"),
        ("832x8x81", r"height 8 is not a multiple of 16 .*nearest: 16"),
        ("832x480", "is not WxHxF"),
        ("832x480x-1", "is not WxHxF"),
        ("a;b", "is not WxHxF"),
        ("832x480x81;832x480x81", "listed twice"),
        (" ; ", "lists no bucket"),
    ],
)
def test_parse_refuses_with_the_nearest_valid_values(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_buckets(spec, spatial_factor=16, temporal_factor=4)


def test_parse_names_every_problem_of_an_entry():
    with pytest.raises(ConfigError) as info:
        parse_buckets("100x100x10", spatial_factor=32, temporal_factor=8)
    text = str(info.value)
    assert "width 100" in text and "height 100" in text and "nearest: 96 or 128" in text
    assert "10 frames is not 8k+1" in text and "nearest: 9 or 17" in text


def test_nearest_frame_counts():
    assert nearest_frame_counts(81, 4) == [81, 85]
    assert nearest_frame_counts(82, 4) == [81, 85]
    assert nearest_frame_counts(2, 8) == [1, 9]


BUCKETS = [
    Bucket(64, 32, 9), Bucket(64, 32, 5), Bucket(32, 64, 9), Bucket(48, 48, 9), Bucket(32, 32, 9), Bucket(32, 32, 1)
]  # fmt: skip


@pytest.mark.parametrize(
    "size, frames, expected",
    [
        ((1920, 1080), 100, Bucket(64, 32, 9)),  # landscape: nearest aspect is 2:1, most frames wins
        ((1920, 1080), 6, Bucket(64, 32, 5)),  # only the 5-frame landscape bucket fits
        ((1080, 1920), 9, Bucket(32, 64, 9)),  # portrait
        ((500, 500), 9, Bucket(48, 48, 9)),  # square: two square buckets, the larger area wins
        ((500, 500), 1, Bucket(32, 32, 1)),  # an image: the F = 1 bucket
        ((1080, 1920), 4, Bucket(32, 32, 1)),  # only F = 1 fits: aspect is secondary to eligibility
    ],
)
def test_choose_bucket_follows_the_ltx_rule(size, frames, expected):
    assert choose_bucket(*size, frames, BUCKETS) == expected


def test_choose_bucket_full_tie_goes_to_the_earlier_bucket():
    # A square clip is as far (in log aspect) from 2:1 as from 1:2; same frames, same area.
    buckets = [Bucket(64, 32, 5), Bucket(32, 64, 5)]
    assert choose_bucket(40, 40, 5, buckets) == Bucket(64, 32, 5)
    assert choose_bucket(40, 40, 5, buckets[::-1]) == Bucket(32, 64, 5)


def test_too_few_frames_is_a_named_reject():
    with pytest.raises(RejectError) as info:
        choose_bucket(64, 32, 4, [Bucket(64, 32, 9), Bucket(64, 32, 5)])
    assert info.value.reason == "too_few_frames"
    assert "4 frames" in info.value.detail and "64x32x5" in info.value.detail
    with pytest.raises(RejectError, match="add a bucket with F = 1"):
        choose_bucket(64, 32, 1, [Bucket(64, 32, 5)])
