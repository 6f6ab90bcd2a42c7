"""Whether a compressed frame is a reference frame, read from its packet's bytes.

A decoder told to skip non-reference frames (``skip_frame`` "NONREF") still outputs every frame
another frame may refer to; knowing which those are lets the sampled decode of :mod:`.frames` say
which frames must come out of the decoder, and notice when one does not (a damaged stream). Each
reader returns None where the bytes do not say (no picture header found): the video is then
decoded whole.

- H.264 (ITU-T H.264 7.3.1): the first slice NAL unit (types 1-5); reference when ``nal_ref_idc``
  is not 0. Length-prefixed NAL units when the stream's extradata is an ``avcC`` record (MP4,
  MKV), else Annex B start codes.
- HEVC (ITU-T H.265 7.4.2.2): the first slice NAL unit (types 0-31); the sub-layer non-reference
  types are the even ones below 16 (TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_VCL_N10/12/14).
  Length-prefixed when the extradata is an ``hvcC`` record.
- MPEG-4 Part 2 (ISO/IEC 14496-2 6.2.5): ``vop_coding_type`` after the VOP start code 0x1B6;
  B-VOPs (2) are not references. A packet with two VOPs (packed B-frames) is not read.
- MPEG-2 (ISO/IEC 13818-2 6.2.3): ``picture_coding_type`` after the picture start code 0x100;
  B-pictures (3) are not references.

A second reader (:func:`state_readers`) lists the units of a packet that a decoder keeps from one
GOP to the next: parameter sets (H.264 SPS, PPS, SPS extension, subset SPS; HEVC VPS, SPS, PPS),
film grain SEI messages (FFmpeg applies them to the pictures that follow), MPEG-4's visual
object sequence, object, object layer and user data headers (FFmpeg picks encoder workarounds,
an IDCT among them, from the user data). A decoder that starts at a key packet decodes what one
that read every packet before it decodes when those units are in the stream's extradata or in the
key packet itself, and the key packet's picture is one decoding can start at (:func:`fresh_entries`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

START_CODE = b"\x00\x00\x01"


def nal_units(data: bytes, length_size: int | None) -> Iterator[bytes]:
    """The NAL units of one packet: ``length_size``-byte big-endian prefixes, or Annex B start codes
    (None; each unit without the zero bytes before the next start code)."""
    if length_size is None:
        yield from (unit.rstrip(b"\x00") for unit in data.split(START_CODE)[1:])
        return
    pos = 0
    while pos + length_size <= len(data):
        size = int.from_bytes(data[pos : pos + length_size], "big")
        pos += length_size
        if size == 0 or pos + size > len(data):
            return
        yield data[pos : pos + size]
        pos += size


def h264_reference(data: bytes, length_size: int | None) -> bool | None:
    for nal in nal_units(data, length_size):
        if nal and 1 <= nal[0] & 0x1F <= 5:
            return (nal[0] >> 5) & 3 != 0
    return None


def hevc_slice_type(data: bytes, length_size: int | None) -> int | None:
    """The NAL unit type of a packet's first slice (types 0-31), None where it has none."""
    for nal in nal_units(data, length_size):
        if len(nal) >= 2 and (nal_type := (nal[0] >> 1) & 0x3F) <= 31:
            return nal_type
    return None


def hevc_reference(data: bytes, length_size: int | None) -> bool | None:
    nal_type = hevc_slice_type(data, length_size)
    return None if nal_type is None else not (nal_type < 16 and nal_type % 2 == 0)


def vop_coding_type(data: bytes) -> int | None:
    """``vop_coding_type`` of a packet's one VOP (0 I, 1 P, 2 B, 3 S), None where it has none or two."""
    vop = START_CODE + b"\xb6"
    first = data.find(vop)
    if first < 0 or first + 4 >= len(data) or data.find(vop, first + 4) >= 0:
        return None
    return data[first + 4] >> 6


def mpeg4_reference(data: bytes) -> bool | None:
    coding_type = vop_coding_type(data)
    return None if coding_type is None else coding_type != 2


def mpeg2_reference(data: bytes) -> bool | None:
    picture = data.find(START_CODE + b"\x00")
    if picture < 0 or picture + 5 >= len(data):
        return None
    return (data[picture + 5] >> 3) & 7 != 3


def length_size(codec: str, extradata: bytes | None) -> int | None:
    """The NAL length prefix of an ``avcC`` / ``hvcC`` record, None for Annex B."""
    if not extradata or extradata[0] != 1:
        return None
    if codec == "h264" and len(extradata) > 4:
        return (extradata[4] & 3) + 1
    if codec == "hevc" and len(extradata) > 21:
        return (extradata[21] & 3) + 1
    return None


# FFmpeg's decoder name -> (the NAL length prefix, None for Annex B) -> a packet's reader.
READERS: dict[str, Callable[[int | None], Callable[[bytes], bool | None]]] = {
    "h264": lambda size: functools.partial(h264_reference, length_size=size),
    "hevc": lambda size: functools.partial(hevc_reference, length_size=size),
    "mpeg4": lambda size: mpeg4_reference,
    "mpeg2video": lambda size: mpeg2_reference,
}


def reference_reader(codec: str, extradata: bytes | None) -> Callable[[bytes], bool | None] | None:
    """A packet -> is-its-frame-a-reference reader for ``codec`` (FFmpeg's decoder name and the
    stream's extradata), or None for a codec not in :data:`READERS`."""
    make = READERS.get(codec)
    return None if make is None else make(length_size(codec, extradata))


# -- what a decoder keeps from one GOP to the next ----------------------------------------------------

H264_STATE_TYPES = frozenset({7, 8, 13, 15})  # SPS, PPS, SPS extension, subset SPS
HEVC_STATE_TYPES = frozenset({32, 33, 34})  # VPS, SPS, PPS
FILM_GRAIN_SEI = 19
MPEG4_STATE_CODES = frozenset({*range(0x30), 0xB0, 0xB2, 0xB5})  # VO, VOL, VOS, user data, visual object
X264_VERSION = re.compile(rb"x264 - core ([0-9]{1,9})(?![0-9])")  # as FFmpeg reads it, at 16 bytes in
USER_DATA_SEI = 5


def rbsp(nal_payload: bytes) -> bytes:
    """A NAL unit's payload without its emulation prevention bytes."""
    return nal_payload.replace(b"\x00\x00\x03", b"\x00\x00")


def sei_messages(payload: bytes) -> Iterator[tuple[int, bytes]]:
    """``(payload type, payload)`` of an SEI NAL unit's messages (``payload``: its RBSP)."""
    pos = 0
    while pos < len(payload) and payload[pos] != 0x80:  # 0x80: the RBSP trailing bits
        values = []
        for _ in range(2):  # payload type, then payload size: runs of 0xFF plus a last byte
            value = 0
            while pos < len(payload) and payload[pos] == 0xFF:
                value, pos = value + 255, pos + 1
            if pos >= len(payload):
                return
            values.append(value + payload[pos])
            pos += 1
        yield values[0], payload[pos : pos + values[1]]
        pos += values[1]


def exp_golomb(data: bytes, count: int) -> list[int]:
    """The first ``count`` unsigned Exp-Golomb codes (``ue(v)``) of ``data``; fewer where it ends."""
    bits = int.from_bytes(data, "big")
    left = len(data) * 8
    values = []
    for _ in range(count):
        zeros = 0
        while left > zeros and not (bits >> (left - zeros - 1)) & 1:
            zeros += 1
        if left < 2 * zeros + 1:
            break
        left -= zeros
        values.append(((bits >> (left - zeros - 1)) & ((1 << (zeros + 1)) - 1)) - 1)
        left -= zeros + 1
    return values


def h264_sei(nal: bytes) -> Iterator[tuple[int, bytes]]:
    """:func:`sei_messages` of an H.264 NAL unit; none where it is not an SEI unit (type 6)."""
    if nal and (nal[0] & 0x1F) == 6:
        yield from sei_messages(rbsp(nal[1:]))


def h264_key_picture(data: bytes, length_size: int | None) -> bool:
    """An IDR picture, or an I picture after a recovery point SEI whose recovery frame count is 0
    (an open GOP's key frame: the frames after it in decode order refer to none before it)."""
    recovery = False
    for nal in nal_units(data, length_size):
        nal_type = nal[0] & 0x1F if nal else 0
        if nal_type == 6:
            recovery |= any(kind == 6 and exp_golomb(body, 1) == [0] for kind, body in h264_sei(nal))
        elif nal_type == 5:
            return True
        elif nal_type == 1:
            header = exp_golomb(rbsp(nal[1:8]), 2)  # first_mb_in_slice, slice_type
            return recovery and len(header) == 2 and header[1] % 5 == 2
    return False


def hevc_key_picture(data: bytes, length_size: int | None) -> bool:
    """An IRAP picture (BLA, IDR or CRA: NAL types 16-23)."""
    return 16 <= (hevc_slice_type(data, length_size) or 0) <= 23


def x264_builds(data: bytes, length_size: int | None) -> frozenset[int]:
    """The x264 builds a packet's user data SEI messages name (after their 16-byte UUID, where
    FFmpeg's H.264 decoder reads one; builds 0 and 1 mean something else to it: -1 here)."""
    builds = set()
    for nal in nal_units(data, length_size):
        for kind, body in h264_sei(nal):
            if kind == USER_DATA_SEI and (match := X264_VERSION.match(body, 16)):
                build = int(match.group(1))
                builds.add(build if build > 1 else -1)
    return frozenset(builds)


def no_builds(data: bytes) -> frozenset[int]:
    return frozenset()


def mpeg4_key_picture(data: bytes) -> bool:
    """One VOP, an I-VOP."""
    return vop_coding_type(data) == 0


def h264_state(data: bytes, length_size: int | None) -> frozenset[bytes]:
    return frozenset(
        nal
        for nal in nal_units(data, length_size)
        if nal and ((nal[0] & 0x1F) in H264_STATE_TYPES or any(kind == FILM_GRAIN_SEI for kind, _ in h264_sei(nal)))
    )


def hevc_state(data: bytes, length_size: int | None) -> frozenset[bytes]:
    return frozenset(
        nal
        for nal in nal_units(data, length_size)
        if len(nal) >= 2
        and (
            (nal_type := (nal[0] >> 1) & 0x3F) in HEVC_STATE_TYPES
            or (nal_type == 39 and any(kind == FILM_GRAIN_SEI for kind, _ in sei_messages(rbsp(nal[2:]))))
        )
    )


def mpeg4_state(data: bytes) -> frozenset[bytes]:
    return frozenset(unit for unit in data.split(START_CODE)[1:] if unit and unit[0] in MPEG4_STATE_CODES)


def record_units(codec: str, extradata: bytes) -> frozenset[bytes]:
    """The NAL units of an ``avcC`` (ISO/IEC 14496-15 5.3.3.1) or ``hvcC`` (8.3.3.1) record:
    counted arrays of 2-byte lengths and units after the record's header."""
    units: list[bytes] = []

    def read(count: int, pos: int) -> int:
        for _ in range(count):
            size = int.from_bytes(extradata[pos : pos + 2], "big")
            units.append(extradata[pos + 2 : pos + 2 + size])
            pos += 2 + size
        return pos

    if codec == "h264":  # SPS count at byte 5, the SPSs, the PPS count, the PPSs
        pos = read(extradata[5] & 0x1F if len(extradata) > 5 else 0, 6)
        if pos < len(extradata):
            read(extradata[pos], pos + 1)
    else:  # array count at byte 22; each array: type, 2-byte unit count, the units
        pos = 23
        for _ in range(extradata[22] if len(extradata) > 22 else 0):
            if pos + 3 > len(extradata):
                break
            pos = read(int.from_bytes(extradata[pos + 1 : pos + 3], "big"), pos + 3)
    return frozenset(units)


@dataclass(frozen=True)
class StateReaders:
    """A codec's readers of what lets a fresh decoder start at a packet: ``state`` (a packet -> its
    units a decoder keeps from GOP to GOP), ``known`` (those units in the extradata), ``key`` (a
    packet -> whether its picture is one decoding can start at), ``builds`` (a packet -> the x264
    builds it names)."""

    state: Callable[[bytes], frozenset[bytes]]
    known: frozenset[bytes]
    key: Callable[[bytes], bool]
    builds: Callable[[bytes], frozenset[int]]


def state_readers(codec: str, extradata: bytes | None) -> StateReaders | None:
    """:class:`StateReaders` for ``codec`` and the stream's extradata; None where they are not read
    (MPEG-2, AV1, ...)."""
    if codec in ("h264", "hevc"):
        size = length_size(codec, extradata)
        state = functools.partial(h264_state if codec == "h264" else hevc_state, length_size=size)
        key = functools.partial(h264_key_picture if codec == "h264" else hevc_key_picture, length_size=size)
        builds = functools.partial(x264_builds, length_size=size) if codec == "h264" else no_builds
        known = frozenset() if not extradata else state(extradata) if size is None else record_units(codec, extradata)
        return StateReaders(state, known, key, builds)
    if codec == "mpeg4":
        return StateReaders(mpeg4_state, mpeg4_state(extradata or b""), mpeg4_key_picture, no_builds)
    return None


def fresh_entries(
    codec: str, extradata: bytes | None, packets: Iterable[bytes], keyframes: Sequence[bool]
) -> tuple[tuple[int, ...], int | None]:
    """The key packets (after the first) where a fresh decoder may start and decode what one that
    read every packet before it decodes, and the x264 build the first packet names (FFmpeg's H.264
    decoder picks workarounds for old builds from it: a fresh decoder is told it). A key packet
    qualifies when its picture is one decoding can start at and every unit :func:`state_readers`
    reads from the packets before it is in the extradata or in the key packet; none does where the
    codec's units are not read, nor from a packet that names another build than the first's.
    ``packets``: their bytes in decode order, read once (an iterator need not hold them all)."""
    readers = state_readers(codec, extradata)
    if readers is None or not any(keyframes[1:]):
        return (), None
    entries: list[int] = []
    seen: set[bytes] = set()
    first_builds: frozenset[int] = frozenset()
    for k, (data, key) in enumerate(zip(packets, keyframes, strict=True)):
        builds = readers.builds(data)
        if k == 0:
            if len(builds) > 1 or -1 in builds:
                return (), None
            first_builds = builds
        elif builds - first_builds:
            break
        units = readers.state(data)
        if key and k > 0 and seen <= readers.known | units and readers.key(data):
            entries.append(k)
        seen |= units
    return tuple(entries), next(iter(first_builds), None)
