"""A video's decode plan: which packets the decoders take and which frames must come out of them,
so that only what the sampled frames need is decoded. A frame that is not sampled is skipped by
the decoder when nothing refers to it (``skip_frame`` "NONREF" for its packet), a run of whole GOPs
with no sampled frame is not sent to the decoder at all (drained and flushed before the next GOP,
as after a seek), and the packets sent are cut into segments that decoders of their own decode at
once. The plan applies where the frame count is the packet count: the packets' pts name each
frame once, in a codec whose decoder gives one frame a packet (:data:`PLANNED_CODECS`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .demux import VideoInfo
from .frame_types import READERS

# Decoders that give one frame a packet, honour ``skip_frame`` per packet (FFmpeg copies it to
# each frame thread as the packet is sent) and whose reference frames :mod:`.frame_types` reads.
PLANNED_CODECS = frozenset(READERS)
# Decoders whose pixels on a damaged stream depend on slice threads, with no error or damage flag
# to tell: HEVC's wavefront rows each start at their entry point under slice threads, where one
# thread reads on from wherever the row before ended. A planned pass of these keeps the
# reference's thread settings (PyAV's: slice threads, FFmpeg's count) instead of frame threads.
REFERENCE_THREADED_CODECS = frozenset({"hevc"})
# Decoders that flag no damaged frame (``frame.is_corrupt``) where they conceal one: a planned pass
# of these stops at the first error FFmpeg finds (``err_detect`` explode), so that the plan ends.
EXPLODING_CODECS = frozenset({"hevc"})


@dataclass(frozen=True)
class Segment:
    """Packets a decoder takes from a fresh start (or a flush): the ``runs`` of packets
    ``[first, end)`` sent, decode order, drained and flushed between runs (whole GOPs not sent lie
    between them); ``shown`` the pts it must output, in order; ``optional`` the leading frames of a
    GOP entered after a flush or at the segment's start, which refer to packets not sent (the
    decoder may drop or conceal them; none is sampled)."""

    runs: tuple[tuple[int, int], ...]
    shown: tuple[int, ...]
    optional: frozenset[int]


@dataclass(frozen=True)
class DecodePlan:
    """What the second pass decodes and what must come out of it: ``sampled`` maps each sampled
    frame's pts to its index; ``segments``, in decode order, each decodable by its own decoder
    (:attr:`VideoInfo.fresh_entries`), their frames in presentation order one after another;
    ``packets`` the stream's packet count."""

    sampled: dict[int, int]
    segments: tuple[Segment, ...]
    packets: int

    @property
    def sent(self) -> tuple[bool, ...]:
        """Whether each packet (decode order) goes to a decoder."""
        sent = [False] * self.packets
        for segment in self.segments:
            for first, end in segment.runs:
                sent[first:end] = [True] * (end - first)
        return tuple(sent)

    @property
    def shown(self) -> tuple[int, ...]:
        return tuple(pts for segment in self.segments for pts in segment.shown)

    @property
    def optional(self) -> frozenset[int]:
        return frozenset().union(*(segment.optional for segment in self.segments))


def decode_plan(info: VideoInfo, indices: Sequence[int]) -> DecodePlan | None:
    """The plan for the sampled frame ``indices``, or None (decode every frame) where a packet has
    no pts or shares one, a frame's reference flag is unknown, the first GOP has leading frames,
    or the codec is not in :data:`PLANNED_CODECS`.

    Frame ``i`` is the packet of the ``i``-th smallest pts (presentation order). The packets are
    cut into GOPs at key packets; a GOP with no sampled frame is not sent, except the GOP before one
    whose sampled frames include a leading frame (shown before its key frame: in an open GOP it
    refers to the GOP before). A new segment starts at each sent GOP whose key packet a fresh
    decoder may start at (:attr:`VideoInfo.fresh_entries`), whose leading frames are not sampled,
    and whose frames all show after every frame before it, in a stream whose frames are evenly
    spaced in time."""
    pts, references = info.pts, info.references
    if info.codec not in PLANNED_CODECS or None in pts or None in references or len(set(pts)) != len(pts):
        return None
    order = sorted(pts)  # type: ignore[type-var]
    sampled = {order[i]: i for i in indices}
    starts = [k for k, key in enumerate(info.keyframes) if key and k > 0]
    gops = list(zip([0, *starts], [*starts, len(pts)], strict=True))
    if any(p < pts[0] for p in pts[: gops[0][1]]):  # type: ignore[operator]
        return None  # a decoder starting here may drop them: the frame count is not the packets'
    needed = [any(p in sampled for p in pts[a:b]) for a, b in gops]
    leading_sampled = [any(p in sampled and p < pts[a] for p in pts[a:b]) for a, b in gops]  # type: ignore[operator]
    for g in range(len(gops) - 1, 0, -1):
        if needed[g] and leading_sampled[g]:
            needed[g - 1] = True
    shows_after = _shows_after_all_before(pts, gops)  # type: ignore[arg-type]
    # A packet the demuxer lost (a damaged container) leaves a gap in time; a decoder that read on
    # across it may drop frames up to the next key frame that a fresh one shows: no cut then.
    entries = set(info.fresh_entries) if len({b - a for a, b in itertools.pairwise(order)}) <= 1 else set()
    segments: list[Segment] = []
    runs: list[tuple[int, int]] = []
    shown: list[int] = []
    optional: set[int] = set()
    for g, (a, b) in enumerate(gops):
        if not needed[g]:
            continue
        after_flush = g > 0 and not needed[g - 1]
        if runs and a in entries and not leading_sampled[g] and shows_after[g]:
            segments.append(Segment(tuple(runs), tuple(sorted(shown)), frozenset(optional)))
            runs, shown, optional = [], [], set()
        entered = g > 0 and (after_flush or not runs)
        for k in range(a, b):
            if entered and pts[k] < pts[a]:  # type: ignore[operator]
                optional.add(pts[k])  # type: ignore[arg-type]
            elif references[k] or pts[k] in sampled:
                shown.append(pts[k])  # type: ignore[arg-type]
        if runs and not after_flush:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    segments.append(Segment(tuple(runs), tuple(sorted(shown)), frozenset(optional)))
    return DecodePlan(sampled, tuple(segments), len(pts))


def _shows_after_all_before(pts: Sequence[int], gops: Sequence[tuple[int, int]]) -> list[bool]:
    """Per GOP: whether its frames but the leading ones show after every frame of the packets
    before it, and every frame after it after those (so segments cut there output in order)."""
    before: list[float] = []
    latest = -math.inf
    for a, b in gops:
        before.append(latest)
        latest = max(latest, *pts[a:b])
    after: list[float] = []
    earliest = math.inf
    for a, b in reversed(gops):
        after.append(earliest)
        earliest = min(earliest, *pts[a:b])
    after.reverse()
    return [before[g] < pts[a] and before[g] < after[g] for g, (a, _) in enumerate(gops)]


# A lane's decoder (a thread, an open of the video) pays for itself on this many packets and more:
# the 10 packets of the HEVC clip in benchmarks/bench_media.py took ~1.1x the time on two lanes.
PACKETS_A_LANE = 50


def plan_lanes(plan: DecodePlan, decoders: int) -> int:
    """The lanes ``plan``'s segments run on with up to ``decoders``: one a :data:`PACKETS_A_LANE`
    packets sent, at least one, at most one a segment."""
    return min(decoders, len(plan.segments), max(1, sum(plan.sent) // PACKETS_A_LANE))
