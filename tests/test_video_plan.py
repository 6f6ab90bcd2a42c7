"""Videos decode only what their sampled frames need (``video.plan.decode_plan``), and stay exact.

Every clip here has frames that refer to others (B-frame pyramids, open and short GOPs, a
variable frame rate, MPEG-4, MPEG-2 and HEVC B-frames); each chunk is compared with
``tests/reference.py``, which decodes every frame. The frames the decoder gave are counted with
``on_frame``: fewer than the stream holds wherever the plan skipped some.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
import reference
from make_inputs import planned_clips, video_clips
from test_media import assert_chunk_equal

import kimi_vision_prep as kvp
from kimi_vision_prep.video import frames, sampling
from kimi_vision_prep.video.demux import VideoInfo, open_video, probe_video
from kimi_vision_prep.video.digest import frame_digest
from kimi_vision_prep.video.frame_types import fresh_entries
from kimi_vision_prep.video.plan import PLANNED_CODECS, decode_plan, plan_lanes
from kimi_vision_prep.video.sampling import sample_frame_indices

opened = open_video


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return planned_clips()


def chunks_and_decoded(data: bytes, preset: str | kvp.Preset) -> tuple[list[kvp.VideoChunkResult], int]:
    decoded = []
    chunks = list(kvp.preprocess_video(data, preset, on_frame=lambda: decoded.append(1)))
    return chunks, len(decoded)


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_sampled_decode_equals_the_reference(
    clips: dict[str, bytes], preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    second_opens: list[dict[str, str] | None] = []  # each open's options (a second decoder's skips the probe)
    monkeypatch.setattr(
        frames, "open_video", lambda data, options=None: second_opens.append(options) or opened(data, options)
    )
    skipped = segmented = 0
    for name, data in clips.items():
        opens = len(second_opens)
        ours, decoded = chunks_and_decoded(data, preset)
        ref = reference.reference_video(data, preset)
        assert len(ours) == len(ref), name
        for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
            assert_chunk_equal(chunk, expected, f"{preset} {name} chunk {i}")
        info = probe_video(data)
        plan = decode_plan(info, sample_frame_indices(info.packets, info.fps, kvp.get_preset(preset)))
        # The decoders gave the frames the plan read as references and the sampled ones, and at
        # most the leading frames of the GOPs a segment starts at (an open GOP's refer to the GOP before).
        assert plan is not None and len(plan.shown) <= decoded <= len(plan.shown) + len(plan.optional), name
        skipped += decoded < info.packets
        segmented += len(plan.segments) > 1
        assert second_opens[opens:].count({"skip_frame": "all"}) == plan_lanes(plan, 2) - 1, name
    if preset == "kimi-k2.5":  # 2 frames a second of 25: B-frames no frame refers to are skipped
        assert skipped == len(clips)
        # Each clip of several GOPs (not the two of one GOP, nor MPEG-2, whose decoder state is not
        # read) is decoded in segments, two decoders at once (under K3 sampled leading frames tie
        # most GOPs to the one before).
        assert segmented == len(clips) - 3


@pytest.mark.parametrize("frames", [2, 3, 5, 7, 9])
def test_gops_without_a_sampled_frame_are_not_decoded(
    clips: dict[str, bytes], frames: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few frames of a clip with short (open) GOPs: whole GOPs are left out, the decoder is
    flushed before the next one, and the chunks are still the reference's."""
    capped = {**reference.PRESETS["kimi-k2.5"], "max_num_frames_each_video": frames}
    monkeypatch.setitem(reference.PRESETS, "custom", capped)
    custom = dataclasses.replace(kvp.KIMI_K25, name="custom", max_num_frames_each_video=frames)
    for name in ("h264_open_gop_keyint20.mkv", "mpeg4_bframes_gop12.mkv", "hevc_bframes_keyint30.mp4"):
        data = clips[name]
        ours, decoded = chunks_and_decoded(data, custom)
        for i, (chunk, expected) in enumerate(zip(ours, reference.reference_video(data, "custom"), strict=True)):
            assert_chunk_equal(chunk, expected, f"{name} {frames} frames chunk {i}")
        info = probe_video(data)
        plan = decode_plan(info, sample_frame_indices(info.packets, info.fps, custom))
        assert plan is not None and len(plan.shown) <= decoded <= len(plan.shown) + len(plan.optional), name
        if frames <= 3:  # 1 to 3 seconds apart: more than a GOP between sampled frames
            assert sum(plan.sent) < info.packets, name


def info(
    pts: list[int | None], keyframes: list[bool], references: list[bool | None] | None = None, codec: str = "h264"
) -> VideoInfo:
    references = [True] * len(pts) if references is None else references
    return VideoInfo(tuple(pts), tuple(keyframes), tuple(references), 25.0, 64, 48, codec)


def test_an_open_gops_sampled_leading_frame_keeps_the_gop_before() -> None:
    # Decode order: I0 P3 B1 B2 | I6 B4 B5 P9 B7 B8 | I12 B10 B11; the Bs refer to nothing, and
    # B4, B5 (B10, B11) are shown before I6 (I12).
    pts = [0, 3, 1, 2, 6, 4, 5, 9, 7, 8, 12, 10, 11]
    keys = [k in (0, 4, 10) for k in range(len(pts))]
    refs = [p % 3 == 0 for p in pts]
    skip_middle = decode_plan(info(pts, keys, refs), [0, 12])
    assert skip_middle.sent == (True,) * 4 + (False,) * 6 + (True,) * 3
    # I12's leading B10, B11 refer to the GOP not decoded: the decoder may drop them.
    assert skip_middle.shown == (0, 3, 12) and skip_middle.optional == {10, 11}
    assert decode_plan(info(pts, keys, refs), [0, 5]).sent == (True,) * 10 + (False,) * 3
    leading = decode_plan(info(pts, keys, refs), [0, 10])  # frame 10: I12's leading frame
    assert leading.sent == (True,) * 13 and leading.sampled == {0: 0, 10: 10}
    assert leading.shown == (0, 3, 6, 9, 10, 12) and not leading.optional


def test_no_plan_where_the_packets_do_not_name_the_frames() -> None:
    keys = [True, False, False]
    assert decode_plan(info([0, None, 2], keys), [0, 2]) is None
    assert decode_plan(info([0, 1, 1], keys), [0, 2]) is None
    assert decode_plan(info([0, 1, 2], keys, [True, None, True]), [0, 2]) is None
    assert decode_plan(info([0, 1, 2], keys, codec="av1"), [0, 2]) is None
    assert decode_plan(info([1, 0, 2], keys), [0, 2]) is None  # the first GOP has a leading frame
    assert decode_plan(info([0, 1, 2], keys), [0, 2]) is not None


def test_the_docs_name_the_planned_codecs() -> None:
    names = {"h264": "H.264", "hevc": "HEVC", "mpeg4": "MPEG-4", "mpeg2video": "MPEG-2"}
    listed = ", ".join(names[codec] for codec in sorted(PLANNED_CODECS, key=list(names).index))
    text = " ".join((Path(__file__).parents[1] / "docs" / "media.md").read_text().split())
    assert f"(`video.plan.PLANNED_CODECS`: {listed})" in text


def test_clips_without_a_plan_decode_every_frame() -> None:
    data = video_clips()["vp9_portrait_180x320.webm"]
    _, decoded = chunks_and_decoded(data, "kimi-k2.5")
    assert decoded == probe_video(data).packets == 24


def test_a_damaged_stream_is_the_references_or_refused(clips: dict[str, bytes]) -> None:
    """A packet's bytes zeroed: the decoder drops frames. Where it drops one the plan needs, the
    video is decoded whole (exact) or, once chunks are out, refused; never another exception."""
    outcomes = set()
    for name in ("h264_open_gop_keyint20.mkv", "mpeg4_bframes_gop12.mkv", "mpeg2_bframes_gop15.mkv"):
        data = clips[name]
        with av.open(io.BytesIO(data)) as container:
            places = [(p.pos, p.size) for p in container.demux(video=0) if p.size]
        for k in (5, 30, 77):
            pos, size = places[k]
            damaged = data[:pos] + bytes(size) + data[pos + size :]
            try:
                ours = list(kvp.preprocess_video(damaged, "kimi-k2.5"))
            except kvp.InvalidVideoError:
                outcomes.add("refused")
                continue
            expected_chunks = reference.reference_video(damaged, "kimi-k2.5")
            for i, (chunk, expected) in enumerate(zip(ours, expected_chunks, strict=True)):
                assert_chunk_equal(chunk, expected, f"{name} packet {k} zeroed, chunk {i}")
            outcomes.add("exact")
    assert outcomes == {"exact", "refused"}


def annex_b(*nals: bytes) -> bytes:
    return b"".join(b"\x00\x00\x00\x01" + nal for nal in nals)


def test_a_fresh_decoder_starts_only_where_it_decodes_as_one_that_read_on() -> None:
    """A key packet is a segment's start only where a decoder starting there keeps what one that
    read every packet before it keeps: the parameter sets (from the extradata or the packet),
    film grain SEI, and a picture decoding can start at (IDR, or I after a recovery point)."""
    sps, pps, other_sps = b"\x67\x64\x00\x1f\xac", b"\x68\xeb\xe3", b"\x67\x64\x00\x28\xac"
    idr, i_slice, p_slice = b"\x65\x88\x84", b"\x41\x88\x84", b"\x41\x9a\x00"  # slice_type 7 (I), 5 (P)
    recovery = b"\x06\x06\x01\x80\x80"  # SEI: a recovery point, recovery_frame_cnt 0
    film_grain = b"\x06\x13\x01\x80\x80"
    x264 = b"\x06\x05\x1f" + bytes(16) + b"x264 - core 164\x80"  # SEI: user data (a 16-byte UUID, text)
    stream = [annex_b(sps, pps, idr), annex_b(p_slice), annex_b(idr), annex_b(recovery, i_slice), annex_b(i_slice)]
    keys = [True, False, True, True, True]
    assert fresh_entries("h264", annex_b(sps, pps), stream, keys) == ((2, 3), None)
    # Parameter sets only in the first packet: a key packet qualifies where it repeats them.
    assert fresh_entries("h264", None, stream, keys) == ((), None)
    assert fresh_entries("h264", None, [*stream, annex_b(sps, pps, idr)], [*keys, True]) == ((5,), None)
    # A parameter set sent in-band after the extradata's, or a film grain SEI: not where it is not repeated.
    assert fresh_entries("h264", annex_b(sps, pps), [stream[0], annex_b(other_sps, p_slice), *stream[2:]], keys) == (
        (),
        None,
    )
    with_grain = [stream[0], annex_b(film_grain, p_slice), *stream[2:]]
    assert fresh_entries("h264", annex_b(sps, pps), with_grain, keys) == ((), None)
    # x264's version SEI in the first packet: a fresh decoder is told the build; none from a packet
    # that names another (or one where the first packet named none).
    assert fresh_entries("h264", annex_b(sps, pps), [annex_b(x264, idr), *stream[1:]], keys) == ((2, 3), 164)
    two_builds = [annex_b(x264, idr), *stream[1:3], annex_b(x264.replace(b"164", b"150"), recovery, i_slice)]
    assert fresh_entries("h264", annex_b(sps, pps), two_builds, [*keys[:4]]) == ((2,), 164)
    named_late = [*stream[:3], annex_b(x264, recovery, i_slice)]
    assert fresh_entries("h264", annex_b(sps, pps), named_late, [*keys[:4]]) == ((2,), None)
    # MPEG-4: the encoder's user data (FFmpeg picks workarounds from it) outside the extradata.
    vol, user_data = b"\x00\x00\x01\x20\x08\xc8", b"\x00\x00\x01\xb2XviD0050"
    i_vop, p_vop = b"\x00\x00\x01\xb6\x10", b"\x00\x00\x01\xb6\x50"
    mpeg4 = [i_vop, p_vop, i_vop, p_vop]
    assert fresh_entries("mpeg4", vol, mpeg4, [True, False, True, True]) == ((2,), None)
    assert fresh_entries("mpeg4", vol, [user_data + i_vop, *mpeg4[1:]], [True, False, True, True]) == ((), None)
    assert fresh_entries("mpeg2video", None, mpeg4, [True, False, True, True]) == ((), None)


def test_segments_start_at_fresh_entries_of_an_unbroken_stream() -> None:
    # Decode order: I0 P3 B1 B2 | I6 B4 B5 P9 B7 B8 | I12 B10 B11 (open GOPs), entries at both I.
    pts = [0, 3, 1, 2, 6, 4, 5, 9, 7, 8, 12, 10, 11]
    keys = [k in (0, 4, 10) for k in range(len(pts))]
    refs = [p % 3 == 0 for p in pts]
    stream = dataclasses.replace(info(pts, keys, refs), fresh_entries=(4, 10))
    plan = decode_plan(stream, [0, 7, 12])
    assert [segment.runs for segment in plan.segments] == [((0, 4),), ((4, 10),), ((10, 13),)]
    assert [segment.optional for segment in plan.segments] == [set(), {4, 5}, {10, 11}]
    assert plan.shown == (0, 3, 6, 7, 9, 12)
    # A sampled leading frame ties its GOP to the one before.
    assert [segment.runs for segment in decode_plan(stream, [0, 5, 12]).segments] == [((0, 10),), ((10, 13),)]
    # A GOP not sent: a flush within a segment where the entry does not qualify, a new segment where it does.
    assert [s.runs for s in decode_plan(stream, [0, 12]).segments] == [((0, 4),), ((10, 13),)]
    no_entries = dataclasses.replace(stream, fresh_entries=(4,))
    assert [s.runs for s in decode_plan(no_entries, [0, 12]).segments] == [((0, 4), (10, 13))]
    # A gap in time (a packet the demuxer lost): one decoder reads on, as the reference's does.
    gap = dataclasses.replace(stream, pts=tuple(p + (p >= 8) for p in pts))
    assert [s.runs for s in decode_plan(gap, [0, 7, 12]).segments] == [((0, 13),)]


def garbled(data: bytes, packet: int, at: float = 0.6) -> bytes:
    """``data`` with 16 bytes of its video packet ``packet`` (decode order; negative: from the end)
    XORed, ``at`` of the way into the packet."""
    with av.open(io.BytesIO(data)) as container:
        packets = [(p.pos, p.size) for p in container.demux(video=0) if p.size]
    pos, size = packets[packet]
    start = pos + int(size * at)
    return data[:start] + bytes(b ^ 0x5A for b in data[start : start + 16]) + data[start + 16 :]


def test_a_stream_damaged_after_chunks_went_out_decodes_as_the_reference(clips: dict[str, bytes]) -> None:
    """Damage the planned decode meets after chunks went out (whether its frame threads flag it
    varies from run to run): the video is decoded whole again as the reference decodes it, the
    frames already handed over checked against it (their digests), the rest taken from it. Pictures
    garbled mid-stream in two H.264 clips, the Annex B stream cut short: each equal to the
    reference (each was refused before). At
    packet 71 of the Annex B clip and 60 of the MP4 the decoder fills a missing picture from a
    buffer of its pool, so a frame must be converted and let go before its decoder takes the next
    packet, as the reference's loop does: held one packet longer, the pixels differ (checked).
    HEVC: at packet 27 only the reference's slice threads, which start each wavefront row at its
    entry point, give the reference's pixels (frame threads differed, silently)."""
    annexb, mp4 = clips["h264_annexb.ts"], clips["h264_bpyramid_keyint250.mp4"]
    damaged_clips = {
        **{f"h264_annexb.ts packet {k}": garbled(annexb, k) for k in (71, 82)},
        **{f"h264_bpyramid_keyint250.mp4 packet {k}": garbled(mp4, k) for k in (16, 60)},
        **{f"h264_annexb.ts cut at {f:.0%}": annexb[: int(len(annexb) * f)] for f in (0.5, 0.71, 0.97)},
        "hevc_bframes_keyint30.mp4 packet 27": garbled(clips["hevc_bframes_keyint30.mp4"], 27),
    }
    for label, damaged in damaged_clips.items():
        ours = list(kvp.preprocess_video(damaged, "kimi-k2.5"))
        expected = reference.reference_video(damaged, "kimi-k2.5")
        assert len(ours) == len(expected), label
        for i, (chunk, ref) in enumerate(zip(ours, expected, strict=True)):
            assert_chunk_equal(chunk, ref, f"{label}, chunk {i}")


@pytest.mark.parametrize("after", [1, 5, 9])
def test_a_plan_that_fails_after_chunks_went_out_goes_on_from_a_whole_decode(
    clips: dict[str, bytes], after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan made to fail after ``after`` sampled frames went out (1: inside the first chunk; 5,
    9: inside later ones), on every clip of several GOPs: the whole decode that follows checks
    those frames and hands over only the rest, so the chunks are the reference's, each frame once."""
    handed = 0
    real = frames.segment_frames

    def failing(*args: object) -> Iterator[tuple[int, object]]:
        nonlocal handed
        for item in real(*args):  # type: ignore[arg-type]
            if handed == after:
                raise frames._PlanMismatch("made to fail")
            handed += 1
            yield item

    monkeypatch.setattr(frames, "segment_frames", failing)
    monkeypatch.setattr(sampling, "segment_decoders", lambda: 1)  # one lane: the count is the order
    for name in ("h264_open_gop_keyint20.mkv", "h264_annexb.ts", "mpeg4_bframes_gop12.mkv"):
        handed = 0
        ours, decoded = chunks_and_decoded(clips[name], "kimi-k2.5")
        expected = reference.reference_video(clips[name], "kimi-k2.5")
        assert handed == after and decoded > probe_video(clips[name]).packets, name  # the plan, then every frame
        assert [c.frame_indices for c in ours] == [r.frame_indices for r in expected], name
        for i, (chunk, ref) in enumerate(zip(ours, expected, strict=True)):
            assert_chunk_equal(chunk, ref, f"{name} failed after {after} frames, chunk {i}")


def test_the_frame_digest_tells_frames_apart_by_every_byte_and_their_shape() -> None:
    """The digest the full pass checks handed-over frames by: equal for equal pixels whether the
    rows are padded or not, different for any one byte changed (every position of a small frame,
    in the four words of a lane group and in a row's tail) and for the same bytes in another shape."""
    rng = np.random.default_rng(7)
    frame = rng.integers(0, 256, (5, 13, 3), dtype=np.uint8)  # rows of 39 bytes: a 32-byte group and a tail
    padded = np.zeros((5, 16, 3), dtype=np.uint8)[:, :13]
    padded[:] = frame
    assert not padded.flags.c_contiguous
    digest = frame_digest(frame)
    assert frame_digest(padded) == digest
    seen = {digest}
    for index in np.ndindex(frame.shape):
        changed = frame.copy()
        changed[index] ^= 1
        seen.add(frame_digest(changed))
    assert len(seen) == frame.size + 1
    assert frame_digest(frame.reshape(13, 5, 3)) != digest


def test_a_sampled_frame_a_whole_decode_gives_otherwise_refuses_the_video(
    clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame the plan handed over that the whole decode gives otherwise (its digest made to
    differ here) refuses the video after its first chunks: never finished with chunks of two
    decodes. Open GOPs with packet 82 garbled, as it comes (the planned decoder may conceal it in a
    B-frame shown before the damaged picture otherwise than the reference's): the reference's
    chunks, or that refusal, never other chunks."""
    damaged = garbled(clips["h264_open_gop_keyint20.mkv"], 82)
    expected = reference.reference_video(damaged, "kimi-k2.5")
    chunks = kvp.preprocess_video(damaged, "kimi-k2.5")
    try:
        for i, (chunk, ref) in enumerate(zip(chunks, expected, strict=True)):
            assert_chunk_equal(chunk, ref, f"open GOPs, packet 82 garbled, chunk {i}")
    except kvp.InvalidVideoError as exc:
        assert "differs from the one already sampled" in str(exc)
    clip = clips["h264_annexb.ts"]
    real_digest, real_frames = frame_digest, frames.segment_frames
    calls = yielded = 0

    def off_by_one(rgb: object) -> int:  # the plan's 5 records (the first calls) made to differ
        nonlocal calls
        calls += 1
        return real_digest(rgb) ^ (calls <= 5)  # type: ignore[arg-type]

    def failing(*args: object) -> Iterator[tuple[int, object]]:  # the plan fails after 5 frames
        nonlocal yielded
        for item in real_frames(*args):  # type: ignore[arg-type]
            if yielded == 5:
                raise frames._PlanMismatch("made to fail")
            yielded += 1
            yield item

    monkeypatch.setattr(frames, "frame_digest", off_by_one)
    monkeypatch.setattr(frames, "segment_frames", failing)
    monkeypatch.setattr(sampling, "segment_decoders", lambda: 1)
    chunks = kvp.preprocess_video(clip, "kimi-k2.5")
    assert next(chunks).frame_indices[0] == 0
    with pytest.raises(kvp.InvalidVideoError, match="differs from the one already sampled"):
        list(chunks)


def test_a_stream_damaged_before_its_first_chunk_decodes_as_the_reference(clips: dict[str, bytes]) -> None:
    """16 bytes of the first picture garbled: where the planned decode sees a frame out of place or
    flagged as damaged before any chunk went out, it decodes the video again as the reference
    does (a new open, PyAV's thread settings: a decoder reused from the planned pass, or one
    thread instead of slice threads, conceals the damage otherwise). Whether frame threads flag
    the damage varies from run to run (a CI run once decoded only the planned 79 frames of the
    open-GOP clip), so the chunks are what is asserted."""
    for name in ("h264_bpyramid_keyint250.mp4", "h264_open_gop_keyint20.mkv", "mpeg4_bframes_gop12.mkv"):
        for offset in (0.3, 0.6):
            damaged = garbled(clips[name], 0, offset)
            ours, _ = chunks_and_decoded(damaged, "kimi-k2.5")
            expected = reference.reference_video(damaged, "kimi-k2.5")
            assert len(ours) == len(expected), (name, offset)
            for i, (chunk, ref) in enumerate(zip(ours, expected, strict=True)):
                assert_chunk_equal(chunk, ref, f"{name} first picture garbled at {offset}, chunk {i}")
